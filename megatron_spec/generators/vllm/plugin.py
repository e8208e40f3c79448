"""The vLLM plugin (entry point `vllm.general_plugins: megatron_spec = megatron_spec.generators.vllm.plugin:register`).

vLLM calls `register()` in every process it starts (the API process, the engine core, each worker), so what it does
holds wherever the model runs:
- registers our MTP drafters' model type with transformers' AutoConfig and our MTP drafter class (`MegatronSpecMTP`, mtp_model.py) in vLLM's model registry, lazily by name;
- makes vLLM's MTP proposer tell that class which draft step it runs (vLLM's generic proposer always asks for the
  first MTP layer; ours applies depth min(step, layers - 1), as our engine does);
- on the CPU platform, installs the correct `expand_batch_to_tokens` (cpu_fix.py), unless the environment variable
  `MEGATRON_SPEC_VLLM_CPU_FIX=0` asks to see vLLM's own behaviour.
"""

from __future__ import annotations

import os

MTP_ARCHITECTURE = "MegatronSpecMTP"


def register() -> None:
    register_config()
    from vllm import ModelRegistry

    if MTP_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MTP_ARCHITECTURE, "megatron_spec.drafters.mtp.vllm:MegatronSpecMTP")
    track_draft_steps()
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("MEGATRON_SPEC_VLLM_CPU_FIX", "1") != "0":
        from . import cpu_fix

        cpu_fix.install()


def register_config() -> None:
    """Teach transformers' AutoConfig the model type of our exported MTP drafters (`MegatronSpecMTPConfig`: vLLM
    parses a drafter's config.json with it, and accepts an MTP drafter only when its model type is an MTP type)."""
    from transformers import AutoConfig

    from ...drafters.mtp.hf_config import MegatronSpecMTPConfig

    try:
        AutoConfig.register(MegatronSpecMTPConfig.model_type, MegatronSpecMTPConfig)
    except ValueError:  # already registered in this process
        pass


def track_draft_steps() -> None:
    """Wrap the proposer's `propose` so that a model with `reset_draft_step()` hears when a new draft chain starts;
    the model counts its own forward calls from there (call 0 reads the target's states, call j drafts token j+1)."""
    from vllm.v1.spec_decode import llm_base_proposer

    cls = llm_base_proposer.SpecDecodeBaseProposer  # EagleProposer (eagle3, mtp) inherits `propose` from it
    if getattr(cls.propose, "_megatron_spec", False):
        return
    original = cls.propose

    def propose(self, *args, **kwargs):
        reset = getattr(getattr(self, "model", None), "reset_draft_step", None)
        if reset is not None:
            reset()
        return original(self, *args, **kwargs)

    propose._megatron_spec = True
    cls.propose = propose
