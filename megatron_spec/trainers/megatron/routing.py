"""Routing replay in Megatron-Core's MoE routers (`grpo.routing_replay`): each micro-batch's forward routes every
token to the experts the rollout recorded for it.

Megatron-Core's router hands its top-k choice to `router.router_replay.get_replay_topk` where that is set (its
RouterReplay facility). Its own RouterReplay replays whole tensors and has no "route freely" rows, which padding and
a row's last token need, and keeps every instance in a process-wide list; `ForcedTopK` is a stand-in with the same
method: the router's own top-k, replaced on the rows the rollout recorded, with the router's scores of the replayed
experts (for Qwen3's router, the softmax over the chosen experts' logits, as the router computes it for its own).

A routing tensor is [B, T, MoE layers, top_k] (`models.routing`); a router sees its micro-batch's tokens in
Megatron's [T, B] order, so layer l's targets are routing[:, :, l] transposed and flattened. Each forward sets its
own targets, so a recompute in the backward (activation recompute) or a sequence split over tensor-parallel ranks
(sequence parallelism) would read another micro-batch's or the whole sequence's: both are refused with replay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import require_megatron

require_megatron()
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402


class ForcedTopK:
    """A router's `router_replay`: `target` [tokens, top_k] (-1 rows: the router's own choice), None: no replay.
    `last` holds the experts of the router's last forward (what a test compares with the rollout's)."""

    def __init__(self):
        self.target: Tensor | None = None
        self.last: Tensor | None = None

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is not None:
            if self.target.shape != chosen.shape:
                raise ValueError(f"routing replay: {tuple(self.target.shape)} targets for a router that routes "
                                 f"{tuple(chosen.shape)}")
            chosen = torch.where(self.target < 0, chosen, self.target)
            probs = scores.gather(1, chosen)
        self.last = chosen.detach()
        return probs, chosen


def install(model, moe_layers: list[int]) -> dict[int, ForcedTopK]:
    """A `ForcedTopK` in each of the policy's MoE routers on this stage (not the MTP layers', whose routing no
    rollout records), by MoE layer index (the routing tensor's layer axis); `moe_layers`: the model's MoE layers'
    numbers (0-based, over the whole model)."""
    index = {layer + 1: i for i, layer in enumerate(moe_layers)}  # Megatron numbers layers from 1, across stages
    forced = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}":
            module.router_replay = forced[index[module.layer_number]] = ForcedTopK()
    return forced


def force(forced: dict[int, ForcedTopK], routing: Tensor | None) -> None:
    """Set each router's targets for the next forward over a micro-batch whose routing is `routing` [b, T, MoE
    layers, k] (None: the routers choose)."""
    for i, replay in forced.items():
        replay.target = None if routing is None else routing[:, :, i].transpose(0, 1).reshape(-1, routing.shape[-1]
                                                                                               ).long()


def last_routing(forced: dict[int, ForcedTopK], batch: int, length: int) -> Tensor:
    """[batch, length, this stage's MoE layers, k]: the experts of each router's last forward, in batch order."""
    layers = [forced[i].last.view(length, batch, -1).transpose(0, 1) for i in sorted(forced)]
    return torch.stack(layers, 2)
