"""Speculative verification as pure functions (Leviathan et al. 2023; Chen et al. 2023).

Given the processed target distributions p at the k+1 positions of a verify pass, k drafted tokens and, for a
sampling drafter, its distributions q: accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token from norm(max(p_i - q_i, 0)); if every draft is accepted emit a bonus token from p_k. A
greedy (deterministic) drafter has q = one-hot(x_i), so it is accepted with probability p_i(x_i) and the residual is
p_i with x_i removed. The emitted tokens then follow p exactly, whatever the drafter proposes.

Deterministic drafts can be verified another way, `verify_coupled`, which emits the very tokens plain sampling
would: draw every position's token from p with that position's own uniform, and let draft i stand while it equals
the token drawn at i. It accepts draft i with the same probability, p_i(x_i), and emits p_i without x_i after a
rejection (the draw, given it is not x_i), so it is the same verifier in distribution and, given each position's
uniform, plain sampling token for token.

Drafts may be ragged: sequence b drafted `draft_len[b]` <= k tokens; positions past its length count as the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample_inverse_cdf


@dataclass
class Verdict:
    num_accepted: Tensor
    """[B] drafts accepted per sequence (0..draft_len)."""
    next_token: Tensor
    """[B] the token emitted after the accepted drafts (residual sample or bonus)."""


def accepted_prefix(accept: Tensor, draft_len: Tensor) -> Tensor:
    """Length [B] of the run of accepted drafts from position 0, capped by each sequence's draft length."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None] < draft_len[:, None]
    return (accept & valid).int().cumprod(-1).sum(-1)


def verify_greedy(target_logprobs: Tensor, drafts: Tensor, draft_len: Tensor) -> Verdict:
    """Greedy verification: accept while the draft equals the target's argmax; then emit the argmax."""
    best = target_logprobs.argmax(-1)  # [B, k+1]
    n = accepted_prefix(best[:, :-1] == drafts, draft_len)
    return Verdict(n, best.gather(1, n[:, None]).squeeze(1))


def verify_coupled(target_probs: Tensor, drafts: Tensor, draft_len: Tensor, u: Tensor) -> Verdict:
    """Verification of deterministic `drafts` [B, k] that emits plain sampling's tokens: position i's token is
    drawn from `target_probs` [B, k+1, V] (processed p) with `u` [B, k+1] (position i's uniform, in [0, 1)), and
    draft i stands while it equals that token; the token drawn at the first position that is not an accepted draft
    is emitted."""
    B, k1, V = target_probs.shape
    drawn = sample_inverse_cdf(target_probs.reshape(B * k1, V), u.reshape(-1)).view(B, k1)
    n = accepted_prefix(drawn[:, :-1] == drafts, draft_len)
    return Verdict(n, drawn.gather(1, n[:, None]).squeeze(1))


def verify_sampled(
    target_probs: Tensor, drafts: Tensor, draft_len: Tensor, u_accept: Tensor, u_next: Tensor,
    draft_probs: Tensor | None = None,
) -> Verdict:
    """Rejection sampling against `target_probs` [B, k+1, V] (processed p).

    `draft_probs` [B, k, V] is the drafter's q, or None for a deterministic drafter (q = one-hot of the draft).
    `u_accept` [B, k] and `u_next` [B] are uniforms in [0, 1).
    """
    B, k = drafts.shape
    if k == 0:  # nothing drafted anywhere: plain sampling of the one position's token
        return Verdict(drafts.new_zeros(B), sample_inverse_cdf(target_probs[:, 0], u_next))
    rows = torch.arange(B, device=drafts.device)
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # p_i(x_i)
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        ratio = p_draft / q_draft.clamp_min(1e-30)
    n = accepted_prefix(u_accept < ratio, draft_len)

    # Distribution of the emitted token: the residual at the first rejection, or p itself after the last draft.
    p_n = target_probs[rows, n]
    rejected = n < draft_len
    if draft_probs is None:
        # max(p - one-hot(x_n), 0) is p with x_n's mass removed: the same values, in a few ops and no boolean
        # indexing (whose nonzero calls were a visible part of a ~1 ms step on the tiny models).
        x_n = drafts.gather(1, n.clamp(max=k - 1)[:, None])
        residual = p_n.scatter(1, x_n, torch.where(rejected[:, None], 0.0, p_n.gather(1, x_n)))
    else:
        residual = (p_n - draft_probs[rows, n.clamp(max=k - 1)] * rejected[:, None]).clamp_min(0)
    # A residual that is all zero can only happen with probability zero (p == q and a rejection); fall back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) <= 0, p_n, residual)
    return Verdict(n, sample_inverse_cdf(residual, u_next))


def emitted_logprobs(logprobs: Tensor, drafts: Tensor, verdict: Verdict) -> Tensor:
    """Log-probs [B, k + 1] of the emitted tokens under `logprobs` [B, k + 1, V]: draft j for j < n, the verdict's
    next token at j = n (columns past it are not emitted). One gather for the batch: per-sequence tensor ops would
    cost more than the forward at small sizes."""
    emitted = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], 1)
    emitted.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])
    return logprobs.gather(-1, emitted[..., None]).squeeze(-1)
