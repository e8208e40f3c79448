"""MoE routing replay on a vLLM engine: each worker records the experts its target model routed every position of
every request to, for the trainer to replay (`grpo.routing_replay`, `models/routing.py`).

vLLM 0.32 returns routed experts only from its Model Runner V2 (GPU, with Triton); its CPU and V1 runners do not.
Every runner does call each MoE router's own capture hook (`BaseRouter.set_capture_fn`) with the expert ids it
chose, so a worker binds one there per MoE layer and maps each forward's rows to requests by the layout the runner
gives its batch: request by request, in the input batch's order, each with its scheduled tokens, at the positions
the model was given. Rows are kept by position, a later forward over a position replacing an earlier one: a
rejected draft's row is replaced when the token sampled in its place is fed at that position, and a continued
request (an in-flight refit) recomputes all its positions under the new weights. The prefix cache must be off
(`VLLMGenerator` turns it off): a cached position is never recomputed, so it would have no row.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ...models.routing import ROUTING_DTYPE

NO_EXPERT = -1
"""A position no forward routed (in `models.routing`, it routes by its own top-k)."""


class RoutingRecorder:
    """Records, per vLLM request, the experts of every MoE layer of the worker's target model at every position."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = runner
        moe = sorted((m.layer_id, m) for m in runner.model.modules() if isinstance(m, MoERunner))
        if not moe:
            raise ValueError("routing replay: the vLLM engine's model has no MoE layer")
        self.layers = len(moe)
        for index, (_, module) in enumerate(moe):
            module.router.set_capture_fn(partial(self.capture, index))
        self.rows: dict[int, torch.Tensor] = {}  # MoE layer index -> this forward's [tokens, top_k]
        self.positions: torch.Tensor | None = None
        self.kept: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # request id -> (positions, rows) in order
        runner.model.register_forward_pre_hook(self._positions, with_kwargs=True)
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.rows, self.positions = {}, None
            out = execute(scheduler_output, *args, **kwargs)
            self.keep(scheduler_output)
            return out

        runner.execute_model = execute_model

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.rows[layer] = topk_ids.to(ROUTING_DTYPE, copy=True)

    def _positions(self, module, args, kwargs) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if self.positions is None and positions is not None:  # the target's forward; a drafter's comes later
            self.positions = positions.detach().to("cpu", copy=True)

    def keep(self, scheduler_output) -> None:
        """File the forward's rows under their requests, in the runner's batch layout."""
        if len(self.rows) != self.layers or self.positions is None:
            return  # no target forward ran in this step
        ids = list(self.runner.input_batch.req_ids)
        counts = [scheduler_output.num_scheduled_tokens[r] for r in ids]
        total = sum(counts)
        rows = torch.stack([self.rows[i][:total] for i in range(self.layers)], 1).numpy()  # [tokens, layers, k]
        positions = self.positions[:total].numpy()
        start = 0
        for rid, n in zip(ids, counts):
            self.kept.setdefault(rid, []).append((positions[start:start + n], rows[start:start + n]))
            start += n

    def take(self, external_ids: list[str]) -> list[bytes | None]:
        """Each request's routing (vLLM suffixes the ids it is given: `<id>-<random>`), as the raw int16 bytes of
        [positions, MoE layers, top_k]; then forget every request (a generate call's are all finished)."""
        by_external = {rid.rsplit("-", 1)[0]: rid for rid in self.kept}
        out = []
        for ext in external_ids:
            chunks = self.kept.get(by_external.get(ext, ext))
            if not chunks:
                out.append(None)
                continue
            length = max(int(p.max()) for p, _ in chunks if len(p)) + 1
            table = np.full((length, *chunks[0][1].shape[1:]), NO_EXPERT, dtype=np.int16)
            for p, r in chunks:  # later forwards over a position replace earlier ones
                table[p] = r
            out.append(table.tobytes())
        self.kept = {}
        return out
