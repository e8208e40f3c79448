"""The EAGLE-3 head's online training pairs: its layer unrolled over its own states (training-time test)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...models.decoder import CausalLM, TrunkOutput
from ..loss import TRAINED_DRAFTS, DepthPair, UnrolledAttention
from .model import Eagle3Head


def eagle3_pairs(target: CausalLM, head: Eagle3Head, input_ids: Tensor, out: TrunkOutput, logits: Tensor,
                 mask: Tensor, unroll: int = TRAINED_DRAFTS) -> list[DepthPair]:
    """Step s (0-based) at row t reads the fused target state (s=0) or its own previous state, and the token t+s+1,
    and predicts token t+s+2 against the trunk's logits at t+s+1, at position t+s and with the attention drafting
    gives it (`UnrolledAttention`). Unrolling trains the head on its own states, as it is used when drafting more
    than one token (EAGLE-3's training-time test). The teacher stays as given (full vocabulary or restricted);
    `drafter_loss` restricts it to a draft vocabulary (module docstring)."""
    hidden = head.fuse(out.layers)
    B, T = input_ids.shape
    attention = UnrolledAttention()
    pairs = []
    for s in range(unroll):
        n = T - s - 1
        if n < 2:
            break
        positions = (torch.arange(n, device=input_ids.device) + s).expand(B, n)
        hidden, lg = head(hidden[:, :n], input_ids[:, s + 1 : s + 1 + n], positions, target.embed, attention)
        m = n - 1  # row t predicts token t+s+2; the last row's label lies past the end
        pairs.append(DepthPair(lg[:, :m], logits[:, s + 1 : s + 1 + m], mask[:, s + 2 : s + 2 + m]))
    return pairs
