"""The processed target distribution and sampling from it: small pure functions.

`processed_logprobs` is THE definition of the distribution a rollout samples from (temperature, then top-k, then
top-p). The engine samples from it, the speculative verifier accepts against it, and the trainer computes its
behaviour log-probs with it, so all three agree by construction.
"""

from __future__ import annotations

import torch
from torch import Tensor


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 means no top-k), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def processed_logprobs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-probabilities [..., V] of the processed distribution; tokens outside top-k / top-p get -inf.

    Temperature 0 (greedy) is treated as temperature 1 here: the greedy token is the argmax either way, and the
    log-prob reported for it is then the model's own. Top-k keeps every token tied with the k-th largest logit, and
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches `top_p` (the top token always).
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token ids [B] drawn from (unnormalised) `probs` [B, V] with uniforms `u` [B] in [0, 1).

    Inverse-CDF sampling needs one uniform per row, which lets every sequence draw from its own seeded generator
    (reproducible whatever else is in the batch). `right=True` never picks a zero-probability token.
    """
    cdf = probs.float().cumsum(-1)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens(logprobs: Tensor, u: Tensor, greedy: bool) -> tuple[Tensor, Tensor]:
    """(token ids [B], their log-probs [B]) from processed `logprobs` [B, V]."""
    tokens = logprobs.argmax(-1) if greedy else sample_inverse_cdf(logprobs.exp(), u)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
