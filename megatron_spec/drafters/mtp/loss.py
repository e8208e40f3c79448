"""The MTP head's online training pairs: each depth, and the last depth chained past them, against the trunk."""

from __future__ import annotations

import torch
from torch import Tensor

from ...models.decoder import CausalLM, TrunkOutput
from ..loss import TRAINED_DRAFTS, DepthPair, UnrolledAttention
from .model import MTP


def mtp_pairs(target: CausalLM, mtp: MTP, input_ids: Tensor, out: TrunkOutput, logits: Tensor,
              mask: Tensor, drafts: int = TRAINED_DRAFTS) -> list[DepthPair]:
    """Draft j (0-based) from row t predicts token t+j+2 against the trunk's logits at t+j+1. Depth i < D makes
    draft i from the previous depth's state (the trunk's for depth 0) and token t+i+1, at position t (Megatron-Core
    rotates by the hidden state's position). Past the D depths the last one is chained, as drafting chains it: its
    own previous state, token t+j+1, position t+j-D+1, and the attention `UnrolledAttention` gives it."""
    B, T = input_ids.shape
    D = len(mtp.layers)
    hidden, attention, pairs = out.hidden.detach(), UnrolledAttention(), []
    for j in range(max(D, drafts)):
        depth = min(j, D - 1)
        n = T - j - 1
        if n < 2:
            break
        positions = (torch.arange(n, device=input_ids.device) + j - depth).expand(B, n)
        hidden, lg = mtp(hidden[:, :n], input_ids[:, j + 1 : j + 1 + n], positions, target.embed, target.lm_head,
                         attention if depth == D - 1 else None, layer=depth)
        m = n - 1  # row t predicts token t+j+2; the last row's label lies past the end
        pairs.append(DepthPair(lg[:, :m], logits[:, j + 1 : j + 1 + m], mask[:, j + 2 : j + 2 + m]))
    return pairs
