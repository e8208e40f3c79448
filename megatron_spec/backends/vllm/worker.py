"""The worker extension vLLM mixes into each of its workers (`worker_extension_cls`), called via `collective_rpc`.

Refit goes through vLLM's own reload path, not `model.load_weights` on a loaded model: after loading, vLLM's CPU
backend repacks every linear layer and empties `.weight`, so a second `load_weights` fails. The layer-wise reload
(`initialize_layerwise_reload` -> `load_weights` -> `finalize_layerwise_reload`) puts each layer back in checkpoint
form, loads it and re-runs `process_weights_after_loading`, for the target and for the drafter alike.

Tensors do not travel as `collective_rpc` arguments on CPU (they arrive as lists or fail to serialise), so the
generator writes one safetensors file per refit, in shared memory (/dev/shm) where the machine has it, and passes
its path; the worker memory-maps it. Whole layers are in one file, so every layer reloads in one piece.
"""

from __future__ import annotations

from .plugin import register

# vLLM imports this module in each worker before it loads the model: registering here too keeps the MTP class and
# the CPU sampler fix in place even where the package's entry point is not installed (e.g. a stale editable
# install); `register` is idempotent, so with the entry point it is a no-op.
register()


class WorkerExtension:
    def megatron_spec_reload(self, path: str, which: str) -> int:
        """Reload the target (`which="target"`) or the drafter (`"drafter"`) from a safetensors file; returns the
        number of tensors read. Raises if asked for a drafter this engine does not have."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        tensors = load_file(path)
        runner = self.model_runner
        if which == "target":
            runner.reload_weights(weights_iterator=iter(tensors.items()))
        elif which == "drafter":
            model = runner.get_draft_model()
            if model is None:
                raise RuntimeError("megatron_spec refit: drafter tensors sent to a vLLM engine without a drafter model")
            initialize_layerwise_reload(model)
            model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        else:
            raise ValueError(f"megatron_spec refit: unknown part {which!r}")
        return len(tensors)

    def megatron_spec_has_drafter(self) -> bool:
        return self.model_runner.get_draft_model() is not None

