"""GRPO as small pure functions: group-relative advantages, the clipped policy-gradient loss, the KL estimate."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards [P, G] (P prompts, G rollouts each) -> advantages [P, G]: reward minus its group's mean, divided by
    the group's std when `normalize_std` (GRPO) or not (Dr. GRPO). A group whose rollouts all scored the same gets
    zero advantage: it carries no signal about which rollout was better."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv


def aggregate(per_token: Tensor, mask: Tensor, mode: str) -> Tensor:
    """`token`: mean over every generated token of the batch (long answers weigh more, DAPO's choice);
    `sequence`: mean within each sequence, then over sequences (the original GRPO)."""
    mask = mask.to(per_token.dtype)
    if mode == "token":
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
    if mode == "sequence":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.mean()
    raise ValueError(f"unknown loss aggregation {mode!r}: use 'token' or 'sequence'")


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token") -> tuple[Tensor, dict]:
    """PPO-clipped surrogate, negated for minimisation.

    logprobs / old_logprobs / mask: [B, T] per generated token; advantages: [B] per sequence.
    ratio = exp(logprobs - old_logprobs); per token -min(ratio * A, clip(ratio, 1-clip_low, 1+clip_high) * A).
    Returns the loss and the fraction of tokens where the clip was active.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    clip_frac = aggregate((clipped < unclipped).float(), mask, "token")
    return aggregate(per_token, mask, agg), {"clip_frac": float(clip_frac)}


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) = E[r - 1 - log r], r = pi_ref / pi: non-negative, unbiased."""
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - 1.0 - log_r
