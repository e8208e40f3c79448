"""GRPO as small pure functions: group-relative advantages, the clipped policy-gradient loss, the KL estimate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossNorm:
    """Denominators of the batch-level means. Aggregated with the *whole* batch's norm, a micro-batch gives its exact
    share of the whole batch's mean; the shares of all micro-batches add up to the one-big-batch loss, and their
    gradients to its gradient. That is what makes gradient accumulation over length buckets an exact rewrite (a
    per-micro-batch mean would weigh a token by the size of the bucket it happened to land in)."""

    tokens: float
    """Generated tokens in the whole batch (at least 1): the denominator of the `token` mean."""
    sequences: int
    """Sequences in the whole batch: the denominator of the `sequence` mean."""

    @classmethod
    def of(cls, mask: Tensor) -> "LossNorm":
        """The norm of the batch whose generated-token mask [B, T] is `mask`."""
        return cls(float(mask.sum().clamp_min(1)), mask.shape[0])


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards [P, G] (P prompts, G rollouts each) -> advantages [P, G]: reward minus its group's mean, divided by
    the group's std when `normalize_std` (GRPO) or not (Dr. GRPO). A group whose rollouts all scored the same gets
    zero advantage: it carries no signal about which rollout was better."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm: LossNorm | None = None) -> Tensor:
    """`token`: mean over every generated token of the batch (long answers weigh more, DAPO's choice);
    `sequence`: mean within each sequence, then over sequences (the original GRPO).
    `norm`: the whole batch's denominators when `per_token` is one micro-batch of it (default: this batch's own)."""
    norm = norm or LossNorm.of(mask)
    mask = mask.to(per_token.dtype)
    if mode == "token":
        return (per_token * mask).sum() / norm.tokens
    if mode == "sequence":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.sum() / norm.sequences
    raise ValueError(f"unknown loss aggregation {mode!r}: use 'token' or 'sequence'")


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token",
                norm: LossNorm | None = None) -> tuple[Tensor, dict]:
    """PPO-clipped surrogate, negated for minimisation.

    logprobs / old_logprobs / mask: [B, T] per generated token; advantages: [B] per sequence.
    ratio = exp(logprobs - old_logprobs); per token -min(ratio * A, clip(ratio, 1-clip_low, 1+clip_high) * A).
    Returns the loss and the fraction of tokens where the clip was active, both as shares of the whole batch's
    means when `norm` is the whole batch's (see `LossNorm`).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    clip_frac = aggregate((clipped < unclipped).float(), mask, "token", norm)
    return aggregate(per_token, mask, agg, norm), {"clip_frac": float(clip_frac)}


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) = E[r - 1 - log r], r = pi_ref / pi: non-negative, unbiased."""
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - 1.0 - log_r
