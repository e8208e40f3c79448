"""The draft model's online training pairs: plain distillation of the target's next-token distribution."""

from __future__ import annotations

from torch import Tensor

from ...models.decoder import CausalLM
from ..loss import DepthPair


def draft_model_pairs(draft: CausalLM, input_ids: Tensor, logits: Tensor, mask: Tensor) -> list[DepthPair]:
    """Distillation: the draft model's next-token distribution against the target's at every position."""
    return [DepthPair(draft(input_ids)[:, :-1], logits[:, :-1], mask[:, 1:])]
