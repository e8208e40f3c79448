"""MoE routing replay: read the experts a forward routed each position to, and force them in another forward.

A routing tensor is [B, T, MoE layers, top_k]: for each input position of a [B, T] batch, the experts each MoE layer
(in layer order) sent it to. The engine reads one after each forward of its model (`choices`) and keeps the rows of
the positions that stand; the trainer runs its forwards inside `replayed`, so that the log-probs it computes and
trains on come from the experts that produced the rollout rather than from its own, numerically different, top-k
(near ties flip under other kernels, batch shapes or precisions). A position marked -1 routes by its own top-k: the
positions no rollout recorded (padding, and a completion's last token, which no forward read).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .layers import MoE

ROUTING_DTYPE = torch.int16
"""Expert indices travel as int16 (every model here has at most 128 experts; -1 marks a position to route freely):
a 235B-A22B rollout's routing is 94 layers x 8 experts x 2 B = 1.5 KB a token."""


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def choices(model: nn.Module, batch: int, length: int) -> Tensor:
    """[batch, length, MoE layers, top_k] (int16, on the model's device): the experts the model's last forward, over
    a [batch, length] input, routed each position to."""
    layers = moe_layers(model)
    picked = torch.stack([m.chosen for m in layers], 1)  # [rows, layers, k]
    return picked.view(batch, length, len(layers), -1).to(ROUTING_DTYPE)


@contextmanager
def replayed(model: nn.Module, routing: Tensor | None):
    """Within the block, the model's forwards over a [B, T] input route position (b, t) of MoE layer l to the experts
    `routing[b, t, l]` ([B, T, layers, top_k], the block's forwards all of that shape; -1: the layer's own top-k).
    None: nothing changes."""
    if routing is None:
        yield
        return
    layers = moe_layers(model)
    if routing.shape[2] != len(layers):
        raise ValueError(f"routing holds {routing.shape[2]} MoE layers, the model has {len(layers)}")
    forced = routing.to(next(model.parameters()).device, torch.long)
    try:
        for i, m in enumerate(layers):
            m.replay = forced[:, :, i].reshape(-1, forced.shape[-1])
        yield
    finally:
        for m in layers:
            m.replay = None
