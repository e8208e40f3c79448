"""Sampler-level losslessness: whatever the drafter proposes, emitted tokens follow the processed target p; and the
coupled verifier of deterministic drafts emits exactly the tokens plain sampling draws with the same uniforms."""

import zlib

import numpy as np
import pytest
import torch

from megatron_spec.speculative.sampling import processed_logprobs, sample_inverse_cdf
from megatron_spec.speculative.verify import accepted_prefix, verify_coupled, verify_greedy, verify_sampled

from .stats import assert_rejects, chi2_quantile_999, goodness_of_fit, noncentrality_gof, power

V, K, N = 8, 3, 400_000
HOT = 1.05
"""The power controls' error: the verifier run against p at 5 % higher temperature, p^(1 / 1.05) renormalised
(`processed_logprobs(log p, 1.05)`: zeros stay zero, so the control's tokens stay inside p's support)."""

WEAK = {("sampled_q", "top_p"): {0, 1}, ("one_hot", "top_k"): {1}, ("one_hot", "top_p"): {0}}
"""The checks (0: first token, 1: second) of `test_emitted_tokens_follow_target` with power < 0.99 against the
5 % temperature error (the cases are named by their kind and their top-k / top-p): there it is not asserted."""


def emitted(p: torch.Tensor, drafts, q, u, coupled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first emitted token of each of N verify calls against p [K + 1, V], and the second among the rows whose
    first token was an accepted draft."""
    if coupled:
        verdict = verify_coupled(p.expand(N, K + 1, V), drafts, torch.full((N,), K), u)
    else:
        verdict = verify_sampled(p.expand(N, K + 1, V), drafts, torch.full((N,), K), u[:, :K], u[:, K], q)
    n = verdict.num_accepted
    rows = n > 0
    return (torch.where(rows, drafts[:, 0], verdict.next_token),
            torch.where(n[rows] > 1, drafts[rows, 1], verdict.next_token[rows]))


@pytest.mark.parametrize("proc", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=4),
                                  dict(temperature=1.0, top_p=0.7)])
@pytest.mark.parametrize("draft_kind", ["sampled_q", "one_hot", "one_hot_coupled"])
def test_emitted_tokens_follow_target(proc, draft_kind):
    """N=400000 independent verify calls with K=3 drafts over V=8 tokens (one_hot_coupled: `verify_coupled`). The
    first emitted token (a draft that was accepted, or the residual sample) and the second (when the first was an
    accepted draft) must follow p at their positions: chi-square against p, threshold at the 99.9 % quantile (false
    alarm 0.001 per assertion).

    Power control: the same draws through the same verifier against p at 5 % higher temperature (`HOT`) must be
    rejected by the same checks against p. Its power, from the noncentral chi-square with lambda = rows *
    sum((p_hot - p)^2 / p) computed here, is >= 0.99 in 20 of the 24 checks (>= 0.996; 1 - 1e-6 or more in 17);
    the four in `WEAK` are not asserted: (sampled_q, top-p) keeps a single token at the first position (that check
    is of the support alone, df 0) and has 21000 rows at the second, of two tokens (power 0.2); (one_hot, top-k)
    has 10000 rows at the second (0.84); (one_hot, top-p) keeps two nearly even tokens at the first, which a 5 %
    temperature error hardly moves (0.6)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((draft_kind, proc)).encode()))
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    p = processed_logprobs(target_logits, **proc).exp()
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    if draft_kind == "sampled_q":
        drafts = torch.multinomial(q, N, replacement=True, generator=g).T  # [N, K], each row drawn from q
        probs = q.expand(N, K, V)
    else:  # a deterministic drafter: always proposes the same (mostly wrong) tokens
        drafts = p[:K].argsort(-1)[:, -2].expand(N, K)  # the runner-up token: often accepted, often rejected
        probs = None
    u = torch.rand(N, K + 1, generator=g)
    coupled = draft_kind == "one_hot_coupled"
    first, second = emitted(p, drafts, probs, u, coupled)
    assert len(second) > 500  # enough accepted first drafts for the chi-square approximation below
    for pos, tokens in enumerate((first, second)):
        chi2, df = goodness_of_fit(np.bincount(tokens.numpy(), minlength=V), p[pos].numpy())
        assert chi2 <= chi2_quantile_999(df)
    hot = processed_logprobs(p.log(), HOT).exp()
    weak = set()
    for pos, tokens in enumerate(emitted(hot, drafts, probs, u, coupled)):
        chi2, df = goodness_of_fit(np.bincount(tokens.numpy(), minlength=V), p[pos].numpy())
        noncentrality = noncentrality_gof(p[pos].numpy(), hot[pos].numpy(), len(tokens))
        if power(*noncentrality) >= 0.99:
            assert_rejects(chi2, df, noncentrality)
        else:
            weak.add(pos)
    assert weak <= WEAK.get((draft_kind, next((k for k in ("top_k", "top_p") if k in proc), "")), set())


def test_zero_probability_drafts_are_never_emitted():
    """A deterministic drafter proposing a token that top-k removed is always rejected, and the residual (p with
    that token removed) is p itself: the first token still follows p (chi-square, false alarm 0.001, 40000 draws).
    Power control: the same draws against p at 5 % higher temperature are rejected (power 0.9997: lambda 51 on
    df 2, computed here from p)."""
    g = torch.Generator().manual_seed(3)
    n = 40_000
    p = processed_logprobs(torch.randn(2, V, generator=g) * 1.5, top_k=3).exp()
    x = int(p[0].argmin())
    u = torch.rand(n, 2, generator=g)

    def first(target):
        v = verify_sampled(target.expand(n, 2, V), torch.full((n, 1), x), torch.ones(n, dtype=torch.long), u[:, :1],
                           u[:, 1])
        assert v.num_accepted.sum() == 0
        return goodness_of_fit(np.bincount(v.next_token.numpy(), minlength=V), p[0].numpy())

    chi2, df = first(p)
    assert chi2 <= chi2_quantile_999(df)
    hot = processed_logprobs(p.log(), HOT).exp()
    assert_rejects(*first(hot), noncentrality_gof(p[0].numpy(), hot[0].numpy(), n))


@pytest.mark.parametrize("coupled", [False, True])
def test_acceptance_rate_matches_theory(coupled):
    """With q one-hot on token x the first draft is accepted with probability p(x), by rejection sampling and by
    the coupled verifier alike: the observed rate over 40000 trials is within 4 standard errors
    (sqrt(p(1-p)/N) ~ 0.0025; false alarm 6e-5). Power control: a verifier that accepts the draft 5 % too often
    (it reads p(x) = 0.317 5 % high, the rest scaled down) misses p(x) by 0.05 p(x) = 6.8 standard errors, so the
    same bound rejects it with probability Phi(2.78) = 0.997 (asserted: the shift is at least 4 standard errors of
    the right rate plus 2.33 of the biased one, power >= 0.99)."""
    n = 40_000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, V, generator=g), -1)
    x = int(p[0].argmax())
    u = torch.rand(n, 2, generator=g)
    drafts, one = torch.full((n, 1), x), torch.ones(n, dtype=torch.long)

    def rate(target):
        if coupled:
            v = verify_coupled(target.expand(n, 2, V), drafts, one, u)
        else:
            v = verify_sampled(target.expand(n, 2, V), drafts, one, u[:, :1], u[:, 1])
        return (v.num_accepted == 1).float().mean().item()

    px = p[0, x].item()
    se = (px * (1 - px) / n) ** 0.5
    assert abs(rate(p) - px) < 4 * se
    biased = p.clone()
    biased[0] *= (1 - 1.05 * px) / (1 - px)
    biased[0, x] = 1.05 * px
    shifted_se = (1.05 * px * (1 - 1.05 * px) / n) ** 0.5
    assert 0.05 * px - 4 * se >= 2.33 * shifted_se  # power >= 0.99 against the biased verifier
    assert abs(rate(biased) - px) >= 4 * se


def test_bonus_token_after_all_accepted_and_ragged_lengths():
    """A draft identical to a one-hot target is always accepted; the bonus comes from p_k. A sequence that drafted
    fewer tokens stops at its own length and its next token comes from p at that position."""
    p = torch.zeros(2, 3, 5)
    p[:, 0, 1] = p[:, 1, 2] = p[:, 2, 3] = 1.0
    drafts = torch.tensor([[1, 2], [1, 0]])
    v = verify_sampled(p, drafts, torch.tensor([2, 1]), torch.rand(2, 2), torch.rand(2))
    assert v.num_accepted.tolist() == [2, 1] and v.next_token.tolist() == [3, 2]


def test_coupled_verification_emits_what_plain_sampling_draws_position_by_position():
    """`verify_coupled` on 5000 random rows (k = 3, draft lengths 0-3, drafts the token plain sampling would draw
    60 % of the time, else another): the emitted tokens are, position by position, exactly `sample_inverse_cdf` of
    that position's p with that position's uniform, i.e. what plain decoding draws, and the count stops at the first
    draft that differs from it or at the draft length. Every count 0-3 occurs."""
    g = torch.Generator().manual_seed(11)
    B = 5000
    p = processed_logprobs(torch.randn(B, K + 1, V, generator=g) * 2, top_k=6).exp()
    u = torch.rand(B, K + 1, generator=g)
    plain = torch.stack([sample_inverse_cdf(p[:, j], u[:, j]) for j in range(K + 1)], 1)
    other = (plain[:, :K] + torch.randint(1, V, (B, K), generator=g)) % V
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, plain[:, :K], other)
    draft_len = torch.randint(0, K + 1, (B,), generator=g)
    v = verify_coupled(p, drafts, draft_len, u)
    for b in range(B):
        n = next(j for j in range(K + 1) if j == draft_len[b] or drafts[b, j] != plain[b, j])
        assert int(v.num_accepted[b]) == n and int(v.next_token[b]) == plain[b, n]
    assert sorted(set(v.num_accepted.tolist())) == [0, 1, 2, 3]


@pytest.mark.parametrize("with_q", [False, True])
def test_no_drafts_anywhere_samples_plainly(with_q):
    """k = 0 (no sequence drafted anything): nothing is accepted and the next token is plain sampling from p at the
    one position, the inverse CDF of u_next, found here by walking the cumulative sum in float64."""
    g = torch.Generator().manual_seed(3)
    B = 6
    p = torch.softmax(torch.randn(B, 1, V, generator=g), -1)
    u = torch.rand(B, generator=g)
    q = torch.empty(B, 0, V) if with_q else None
    v = verify_sampled(p, torch.empty(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.empty(B, 0),
                       u, q)
    expected = []
    for b in range(B):
        probs = p[b, 0].double().tolist()
        target, acc = float(u[b]) * sum(probs), 0.0
        expected.append(next(i for i, pr in enumerate(probs) if (acc := acc + pr) > target))
    assert v.num_accepted.tolist() == [0] * B and v.next_token.tolist() == expected
    assert verify_greedy(torch.log(p), torch.empty(B, 0, dtype=torch.long),
                         torch.zeros(B, dtype=torch.long)).next_token.tolist() == p[:, 0].argmax(-1).tolist()


def test_greedy_verification():
    logp = torch.log_softmax(torch.tensor([[[0.0, 5, 0], [0, 0, 5], [5, 0, 0]]]), -1)
    assert verify_greedy(logp, torch.tensor([[1, 2]]), torch.tensor([2])).num_accepted.tolist() == [2]
    v = verify_greedy(logp, torch.tensor([[1, 0]]), torch.tensor([2]))
    assert v.num_accepted.tolist() == [1] and v.next_token.tolist() == [2]
    assert accepted_prefix(torch.tensor([[True, False, True]]), torch.tensor([3])).tolist() == [1]
