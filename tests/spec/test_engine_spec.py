"""Speculative decoding in the engine: greedy identity for every drafter, sampled distributions equal to plain
decoding, exact logprobs, KV rollback, MTP/EAGLE-3 incremental drafting equal to drafting from scratch, and
bad input."""

import copy

import numpy as np
import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import MTP, CausalLM, Eagle3Head, MTPConfig, preset
from megatron_spec.spec.adaptive import AdaptiveController
from megatron_spec.spec.config import SpecConfig
from megatron_spec.spec.proposers import HiddenStateProposer
from megatron_spec.spec.sampling import processed_logprobs

from .hidden_reference import reference_hidden_drafts
from .stats import chi2_quantile_999, homogeneity

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [3], [20, 21, 20, 21, 20], [40] * 6, [33, 34]]


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model


def noisy_copy(model, scale, seed):
    """A draft model that agrees with the target often but not always (partial acceptance exercises rollback)."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale)
    return draft


def drafters(target):
    torch.manual_seed(1)
    return {
        "ngram": (SpecConfig("ngram", 3), None),
        "history": (SpecConfig("history", 3), None),
        "draft_model": (SpecConfig("draft_model", 4), noisy_copy(target, 0.005, 2)),
        "draft_model_small": (SpecConfig("draft_model", 2), CausalLM(preset("tiny-draft"))),
        "mtp": (SpecConfig("mtp", 3), MTP(target.config, MTPConfig(1))),
        "mtp_2_layers": (SpecConfig("mtp", 4), MTP(target.config, MTPConfig(2))),
        "eagle3": (SpecConfig("eagle3", 3), Eagle3Head.from_target(target)),
        "ngram_adaptive": (SpecConfig("ngram", 4, adaptive=True), None),
    }


@pytest.mark.parametrize("name", ["ngram", "history", "draft_model", "draft_model_small", "mtp", "mtp_2_layers",
                                  "eagle3", "ngram_adaptive"])
def test_greedy_identity(target, name):
    """Every drafter emits exactly the plain engine's greedy tokens (batch capacity 4 with 6 prompts, so
    sequences join and leave mid-flight), with the same stop reasons."""
    spec, drafter = drafters(target)[name]
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = LLMEngine(target, max_num_seqs=4).generate(PROMPTS, params)
    fast = LLMEngine(target, max_num_seqs=4, spec=spec, drafter=drafter).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    assert sum(o.spec.get("drafted", 0) for o in fast) > 0


def test_partial_acceptance_happens(target):
    """The noisy draft model is accepted at some positions and rejected at others, so the rollback path runs."""
    spec, drafter = drafters(target)["draft_model"]
    outs = LLMEngine(target, spec=spec, drafter=drafter).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30))
    drafted = sum(o.spec["drafted"] for o in outs)
    accepted = sum(o.spec["accepted"] for o in outs)
    assert 0.2 * drafted < accepted < 0.95 * drafted


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=8), dict(temperature=1.0, top_p=0.8)])
def test_sampled_completions_match_plain_decoding(target, kw):
    """2000 three-token completions of one prompt, plain vs speculative (noisy draft model, k=3, sampled drafts
    with their q in verification): for each of the three positions a two-sample chi-square test of the token
    frequencies, threshold the 99.9 % quantile (false alarm 0.001 per assertion, fixed seeds)."""
    assert_sampled_matches_plain(target, kw)


def assert_sampled_matches_plain(target, kw: dict) -> None:
    """The body of `test_sampled_completions_match_plain_decoding`, for a target on any device (tests/gpu)."""
    spec = SpecConfig("draft_model", 3, draft_sampling=True)
    draft = noisy_copy(target, 0.005, 5)
    n, prompt = 2000, [5, 6, 7]
    params = SamplingParams(max_tokens=3, seed=17, **kw)
    plain = LLMEngine(target, max_num_seqs=250).generate([prompt] * n, params)
    params_b = SamplingParams(max_tokens=3, seed=18, **kw)
    fast = LLMEngine(target, max_num_seqs=250, spec=spec, drafter=draft).generate([prompt] * n, params_b)
    assert sum(o.spec.get("accepted", 0) for o in fast) > n // 2  # speculation really ran and was accepted
    for pos in range(3):
        a = np.bincount([o.token_ids[pos] for o in plain], minlength=64)
        b = np.bincount([o.token_ids[pos] for o in fast], minlength=64)
        chi2, df = homogeneity(a, b)
        assert chi2 <= chi2_quantile_999(df)


@pytest.mark.parametrize("name", ["draft_model", "mtp", "history"])
def test_speculative_logprobs_equal_full_forward(target, name):
    """Logprobs returned for accepted drafts and residual/bonus tokens equal a full forward's (1e-5, fp32)."""
    spec, drafter = drafters(target)[name]
    kw = dict(temperature=0.8, top_p=0.9)
    outs = LLMEngine(target, spec=spec, drafter=drafter).generate(PROMPTS, SamplingParams(max_tokens=20, seed=2, **kw))
    assert_logprobs_equal_full_forward(target, outs, kw)


def assert_logprobs_equal_full_forward(target, outs, sampling: dict, atol: float = 1e-5) -> None:
    """Each completion's returned log-probs equal those of one full forward over prompt + completion (`atol`)."""
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + out.token_ids], device=target.device))[0, len(prompt) - 1 : -1]
        lp = processed_logprobs(logits.cpu(), **sampling)
        ref = lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1).numpy()
        assert np.allclose(out.logprobs, ref, atol=atol)


def test_kv_cache_after_partial_acceptance_equals_fresh_forward(target):
    """After speculative steps with rejections, the cached keys/values of every live position equal those of a
    fresh prefill over the accepted tokens (rejected drafts leave nothing behind that attention can see)."""
    spec, drafter = drafters(target)["draft_model"]
    engine = LLMEngine(target, max_num_seqs=8, spec=spec, drafter=drafter)
    seqs = engine.start(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    with torch.inference_mode():
        for _ in range(6):
            engine.step()
    fresh = LLMEngine(target, max_num_seqs=8)
    assert any(s.accepted_per_pos and sum(s.accepted_per_pos) < s.drafted for s in seqs)
    for s in seqs:
        n = s.num_cached
        assert n == s.length - 1
        fresh.start([s.tokens[:n]], SamplingParams(temperature=0, max_tokens=1))
        with torch.inference_mode():
            fresh.step()  # prefill fills the cache for the n accepted tokens
        k_live = engine.cache.k[:, s.slot, :, :, :n]  # keys are stored transposed: [..., head_dim, max_len]
        k_ref = fresh.cache.k[:, 0, :, :, :n]
        assert torch.allclose(k_live, k_ref, atol=1e-5)
        assert torch.allclose(engine.cache.v[:, s.slot, :, :n], fresh.cache.v[:, 0, :, :n], atol=1e-5)


@pytest.mark.parametrize("layers,k", [(1, 3), (2, 2), (2, 4)])
def test_incremental_mtp_drafts_equal_drafts_from_scratch(target, layers, k):
    """The proposer's cached catch-up (frontier, provisional rows, chaining) drafts exactly what full forwards
    over the whole sequence would, at every step of a generation with rejections."""
    torch.manual_seed(layers)
    head = MTP(target.config, MTPConfig(layers))
    head.reset_parameters(std=0.15)
    _check_incremental(target, head, k)


def test_incremental_eagle3_drafts_equal_drafts_from_scratch(target):
    torch.manual_seed(4)
    head = Eagle3Head.from_target(target)
    head.reset_parameters(std=0.15)
    _check_incremental(target, head, 3)


def incremental_drafts(engine: LLMEngine, prompts=PROMPTS[:3], max_tokens=12) -> list[tuple[list[int], list[int]]]:
    """(sequence tokens before a round, drafts of that round) for every round of a short greedy generation."""
    proposer: HiddenStateProposer = engine.proposer
    seen, original = [], proposer.propose

    def spy(seqs, kk):
        before = [s.tokens for s in seqs]
        drafts = original(seqs, kk)
        seen.extend(zip(before, drafts.tokens))
        return drafts

    proposer.propose = spy
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert len(seen) > 10
    return seen


def _check_incremental(target, head, k):
    engine = LLMEngine(target, spec=SpecConfig("mtp" if isinstance(head, MTP) else "eagle3", k), drafter=head)
    for tokens, drafts in incremental_drafts(engine):
        assert drafts == reference_hidden_drafts(target, head, tokens, len(drafts))[0]


def test_adaptive_turns_speculation_off_when_it_cannot_pay():
    """Compute-bound verify (cost grows with B*T) and poor acceptance: the fitted model picks k=0. Memory-bound
    verify (flat in T) and high acceptance: it picks the deepest k."""
    ctl = AdaptiveController(k_max=4)
    for b in (8, 16, 32):
        for t in (1, 3, 5):
            ctl.record_step(b, t, 0.001 + 0.0005 * b * t)
    ctl.record_draft(32, 4, 0.002)
    ctl.record_draft(32, 4, 0.002)  # the first drafting timing is dropped as a one-off
    ctl.accept[:] = 0.2
    assert ctl.choose_k(32) == 0
    ctl = AdaptiveController(k_max=4)
    for b in (1, 2, 4):
        for t in (1, 3, 5):
            ctl.record_step(b, t, 0.050 + 0.0001 * b * t)
    ctl.record_draft(1, 4, 0.004)
    ctl.record_draft(1, 4, 0.004)
    ctl.accept[:] = 0.8
    assert ctl.choose_k(1) == 4


def test_adaptive_drops_one_off_first_timings():
    """The first drafting call of an engine catches the drafter up over every prompt, and the first verify of a new
    shape pays one-off costs. Here the first draft of 3 tokens took 50 ms (80x the steady 0.6 ms) and the first
    T=4 step 20 ms: counted, drafting would be priced at 4.3 ms per token and k=3 at 3.44 tokens per ~20 ms, far
    below plain decoding's 1 token per 1 ms, so speculation would stay off for the whole run. Dropped, the steady
    costs make k=3 the best choice: 3.44 tokens per 2.1 ms (1640 tok/s) against k=2's 2.71 per 1.73 ms (1560),
    k=1's 1.9 per 1.37 ms (1390) and plain's 1000."""
    ctl = AdaptiveController(k_max=3)
    ctl.accept[:] = 0.9
    ctl.record_step(1, 4, 0.020)
    ctl.record_draft(1, 3, 0.050)
    for _ in range(3):
        ctl.record_step(1, 1, 0.001)  # the first of these is dropped too, the rest count
        ctl.record_step(1, 4, 0.0015)
        ctl.record_draft(1, 3, 0.0006)
    assert ctl.choose_k(1) == 3


def test_bad_spec_input(target):
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpecConfig("ngram", 0)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpecConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=2)
    other_vocab = CausalLM(preset("tiny-draft").__class__(**{**preset("tiny-draft").__dict__, "vocab_size": 80}))
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(target, spec=SpecConfig("draft_model", 3), drafter=other_vocab)
    with pytest.raises(ValueError, match="needs a drafter"):
        LLMEngine(target, spec=SpecConfig("mtp", 3))
    with pytest.raises(ValueError, match="needs a MTP drafter"):
        LLMEngine(target, spec=SpecConfig("mtp", 3), drafter=CausalLM(preset("tiny-draft")))
    wide = CausalLM(preset("smollm2-135m").__class__(**{**preset("tiny-qwen3").__dict__, "hidden_size": 96}))
    with pytest.raises(ValueError, match="hidden size"):
        LLMEngine(target, spec=SpecConfig("mtp", 3), drafter=MTP(wide.config))


def test_adaptive_acceptance_estimate_is_conditional_per_position():
    """Three sequences drafted (3, 3, 2) tokens and had (3, 1, 0) accepted. Position 0 was offered to all three and
    taken by two (2/3); position 1 only reaches sequences whose first draft stood (0 and 1), one took it (1/2);
    position 2 reached sequence 0 only, which took it (1/1). With ema=1 the estimate is exactly these ratios."""
    ctl = AdaptiveController(k_max=4, ema=1.0)
    ctl.accept[:] = 0.5
    ctl.asked = 3  # the step asked for 3 drafts
    ctl.record_acceptance([3, 3, 2], [3, 1, 0])
    assert ctl.accept.tolist() == pytest.approx([2 / 3, 1 / 2, 1.0, 0.5])  # position 3 never offered: unchanged


def test_adaptive_counts_missing_lookup_drafts_as_misses():
    """A lookup drafter (n-gram, history) often has no match. Asked for k=3, one sequence drafted 3 tokens and had
    all accepted, the other found nothing: position 0 was reached by both and taken by one (1/2), and a sequence
    with 2 of 3 asked drafts, both accepted, misses at position 2. Counting only sequences that drafted (1.0 at
    position 0) made the controller price a half-empty batch as full and speculate where it lost (n-gram, bf16
    SmolLM2, RL row: 0.72x). The controller then prefers plain decoding for the half-empty drafter."""
    ctl = AdaptiveController(k_max=3, ema=1.0)
    ctl.asked = 3
    ctl.record_acceptance([3, 0], [3, 0])
    assert ctl.accept.tolist() == pytest.approx([1 / 2, 1.0, 1.0])
    ctl.record_acceptance([2], [2])
    assert ctl.accept.tolist() == pytest.approx([1.0, 1.0, 0.0])

    def controller(accept):
        ctl = AdaptiveController(k_max=3)
        for _ in range(3):
            for t in (1, 2, 4):  # a verify pass over 2 tokens costs 1.5x a decode step, over 4 tokens 2.4x
                ctl.record_step(8, t, 0.010 + 0.0006 * 8 * (t - 1))
            ctl.record_draft(8, 3, 0.0003)
        ctl.accept[:] = accept
        return ctl.choose_k(8)

    assert controller([0.8, 0.8, 0.8]) > 0  # every row drafts: k=1 gives 1.8 tokens for 1.5 steps' time, pays
    assert controller([0.4, 0.8, 0.8]) == 0  # half the rows draft: 1.4 tokens for 1.5 steps does not, nor deeper


def test_adaptive_hot_path_refits_only_at_decisions():
    """Between decisions `choose_k` is a lookup: over 64 steps of one batch size the cost model is refitted at
    most once per `refit_every` steps (a fit per ~1 ms step would cost several percent of it)."""
    ctl = AdaptiveController(k_max=3)
    for b, t in ((8, 1), (8, 2), (8, 4)) * 2:
        ctl.record_step(b, t, 0.001 * t)
    ctl.record_draft(8, 3, 0.0003)
    ctl.record_draft(8, 3, 0.0003)
    fits = []
    original = ctl.fit_step
    ctl.fit_step = lambda: fits.append(1) or original()
    for _ in range(64):
        ctl.choose_k(8)
        ctl.record_step(8, 1, 0.001)
    assert 1 <= len(fits) <= 64 // ctl.refit_every + 1


def test_adaptive_least_squares_matches_numpy_and_survives_rank_deficiency():
    """The controller's pure-Python fit (numpy's fixed cost between engine steps was 5 % of a tiny-model step)
    recovers an exact linear law and agrees with numpy's least squares on noisy data, both to 1e-4 relative (its
    1e-9 ridge moves the coefficients by ~2e-6), and on a
    rank-deficient design (every draft at the same k: columns 1 and k equal) returns finite coefficients whose
    predictions still fit the data."""
    import numpy as np

    from megatron_spec.spec.adaptive import least_squares

    rows = [(1.0, b * t, b) for b in (1, 4, 16) for t in (1, 2, 4)]
    exact = [0.002 + 0.0005 * bt + 0.0001 * b for _, bt, b in rows]
    assert least_squares(rows, exact) == pytest.approx((0.002, 0.0005, 0.0001), rel=1e-4)
    rng = np.random.default_rng(0)
    noisy = [y * (1 + 0.1 * rng.standard_normal()) for y in exact]
    reference = np.linalg.lstsq(np.array(rows), np.array(noisy), rcond=None)[0]
    assert least_squares(rows, noisy) == pytest.approx(tuple(reference), rel=1e-4)
    flat = [(1.0, 3.0, 3.0 * b) for b in (1, 2, 4)]  # k = 3 throughout
    times = [0.001 + 0.0002 * b for b in (1, 2, 4)]
    coef = least_squares(flat, times)
    assert all(np.isfinite(coef))
    assert [sum(c * x for c, x in zip(coef, r)) for r in flat] == pytest.approx(times, rel=1e-6)


@pytest.mark.parametrize("method,max_pending", [("mtp", 64 << 20), ("mtp", 10_000), ("eagle3", 64 << 20),
                                                ("eagle3", 10_000)])
def test_hidden_drafters_after_spans_without_speculation(target, method, max_pending, monkeypatch):
    """A hidden-state drafter holds the target states of steps that do not speculate and writes them in one batch
    before its next draft (or once it holds `MAX_PENDING_BYTES`, here also a few steps' worth). Under a schedule of
    k with spans of plain steps, and sequences joining freed slots (6 prompts, 4 slots), every draft equals the one
    full forwards over the sequence give, and the greedy tokens equal plain decoding's. A state left unwritten or
    written to the wrong place changes the drafts, and so does a depth of a 2-layer MTP head left out of a round
    whose k is 1 (its keys would be missing from then on)."""
    from itertools import cycle

    from megatron_spec.spec.proposers import hidden

    monkeypatch.setattr(hidden, "MAX_PENDING_BYTES", max_pending)
    torch.manual_seed(7)
    head = MTP(target.config, MTPConfig(2)) if method == "mtp" else Eagle3Head.from_target(target)
    head.reset_parameters(std=0.15)
    engine = LLMEngine(target, max_num_seqs=4, spec=SpecConfig(method, 3, adaptive=True), drafter=head)
    script = cycle([0, 0, 0, 0, 0, 2, 3, 0, 0, 1])
    engine.controller.choose_k = lambda batch: next(script)
    for tokens, drafts in incremental_drafts(engine, PROMPTS, 30):
        assert drafts == reference_hidden_drafts(target, head, tokens, len(drafts))[0]
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = LLMEngine(target, max_num_seqs=4).generate(PROMPTS, params)
    script = cycle([0, 0, 0, 0, 0, 2, 3, 0, 0, 1])
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in plain]


def test_feature_writes_apply_in_order():
    """`write_rows` applies several forwards' states (each as parts laid side by side, as EAGLE-3's captured layers
    are) in one copy; where two land on one (slot, position), as when a freed slot takes a new sequence while writes
    are held, the later one stands; padding positions are dropped."""
    from megatron_spec.spec.proposers.hidden import write_rows

    buffer = torch.zeros(2, 4, 2)
    first = torch.arange(12.0).view(2, 3, 2)  # slots 0 and 1 from position 0; slot 1 has 1 valid position of 3
    second = torch.full((1, 2, 2), -1.0)  # slot 1 again, positions 0-1: overwrites the first write's position 0
    write_rows(buffer, [([0, 1], [0, 0], [3, 1], (first[..., :1], first[..., 1:])),
                        ([1], [0], [2], (second[..., :1], second[..., 1:]))])
    assert buffer[0, :3].tolist() == first[0].tolist() and buffer[0, 3].tolist() == [0, 0]
    assert buffer[1].tolist() == [[-1, -1], [-1, -1], [0, 0], [0, 0]]


def test_adaptive_times_only_steady_state_drafting(target):
    """A draft right after a plain (or prefill) step includes the hidden-state drafter catching up over the positions
    it skipped, and a plain step right after a drafting one runs with the drafter's weights in cache, so only steady
    steps (like their predecessor) are timed as what their kind costs. With the choices 0, 1, 1, 0, 1, 2, 1, 0, 0:
    drafting times arrive for the three drafting steps after drafting (k = 1, 2, 1); verify timings (T = k + 1) for
    every step but the two plain steps after drafting; whole-step outcomes for the steady steps only. Unpaired
    probes would never calibrate the controller, so exploration probes come in pairs."""
    engine = LLMEngine(target, spec=SpecConfig("mtp", 2, adaptive=True), drafter=MTP(target.config))
    script = iter([0, 1, 1, 0, 1, 2, 1, 0, 0] + [0] * 64)
    engine.controller.choose_k = lambda batch: next(script)
    drafts, steps, outcomes = [], [], []
    engine.controller.record_draft = lambda batch, k, seconds: drafts.append(k)
    engine.controller.record_step = lambda batch, tokens, seconds: steps.append(tokens)
    engine.controller.record_outcome = lambda batch, k, tokens, seconds: outcomes.append(k)
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert drafts == [1, 2, 1]
    assert steps[:7] == [1, 2, 2, 2, 3, 2, 1]
    assert outcomes[:5] == [0, 1, 2, 1, 0]
    ctl = AdaptiveController(k_max=3)
    assert [ctl.choose_k(8) for _ in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]  # uncalibrated: paired probes


def test_adaptive_realized_outcomes_overrule_the_model_per_batch_octave():
    """The fitted costs say a verify over 2 tokens costs 1.25x a decode step and acceptance is 0.5: k=1 predicts
    1.5 / 1.25 = 1.2x plain, beyond the 5 % margin, at every batch size. At B=64 the steps actually run at 0.7 of
    the predicted rate with k=1 (a large verify the fit mispredicts) and at 1.0 plain: after CORRECTION_MIN such
    outcomes the controller picks plain decoding at B=33..64 (0.84x), and still k=1 at B=8, whose octave has no
    outcomes. Fewer are not enough to overrule it; the first outcome of each (batch, k) is not counted (it pays
    one-off kernel builds: here 0.01x, which would otherwise pull the median down); and a single stalled step
    (0.05x) among three k=1 outcomes of another octave does not rule either: the median does. Ratios expire after
    CORRECTION_HORIZON probe periods, so a cell the controller stopped choosing is tried again."""
    from megatron_spec.spec.adaptive import CORRECTION_HORIZON, CORRECTION_MIN

    def controller():
        ctl = AdaptiveController(k_max=1)
        for b in (4, 8, 64):
            for _ in range(3):
                for t in (1, 2):
                    ctl.record_step(b, t, 0.004 * (1 + 0.25 * (t - 1)))
        ctl.record_draft(8, 1, 0.0)
        ctl.record_draft(8, 1, 0.0)
        ctl.accept[:] = 0.5
        ctl.refresh_fits()
        return ctl

    def outcome(ctl, batch, k, ratio):
        ctl.record_outcome(batch, k, 10, 10 / (ratio * ctl.rate(batch, k)))

    ctl = controller()
    assert ctl.best_k(64) == 1 and ctl.best_k(8) == 1
    outcome(ctl, 64, 1, 0.01)  # first of (64, 1) and of (64, 0): dropped
    outcome(ctl, 64, 0, 0.01)
    for _ in range(CORRECTION_MIN - 1):
        outcome(ctl, 64, 1, 0.7)
        outcome(ctl, 64, 0, 1.0)
    assert ctl.best_k(64) == 1
    outcome(ctl, 64, 1, 0.7)
    outcome(ctl, 64, 0, 1.0)
    assert ctl.best_k(64) == 0 and ctl.best_k(40) == 0 and ctl.best_k(8) == 1
    ctl.steps += CORRECTION_HORIZON * ctl.probe_every
    assert ctl.best_k(64) == 1  # the ratios expired: k=1 is tried again
    ctl = controller()
    for ratio in (1.0, 1.0, 0.05, 1.0):
        outcome(ctl, 8, 1, ratio)
    assert ctl.best_k(8) == 1


def test_adaptive_acceptance_weighs_each_sequence():
    """The acceptance estimate is decayed hits over decayed sequences offered, the prior (0.7) worth 4 sequences:
    one verify step of 64 sequences of which 6 accepted their draft brings position 0 to (0.9 x 2.8 + 6) /
    (0.9 x 4 + 64) = 0.126, where a per-step moving average (weight 0.1) would still say 0.64 and keep
    speculating; a single sequence's miss moves it only to (0.9 x 2.8) / (0.9 x 4 + 1) = 0.548."""
    ctl = AdaptiveController(k_max=2)
    ctl.asked = 1
    ctl.record_acceptance([1] * 64, [1] * 6 + [0] * 58)
    assert ctl.accept[0] == pytest.approx((0.9 * 2.8 + 6) / (0.9 * 4 + 64))
    assert ctl.accept[1] == pytest.approx(0.7)  # not asked for: unchanged
    one = AdaptiveController(k_max=2)
    one.asked = 1
    one.record_acceptance([1], [0])
    assert one.accept[0] == pytest.approx(0.9 * 2.8 / (0.9 * 4 + 1))


def test_adaptive_step_fit_stays_physical():
    """Step times seen only at B=61-64 (a lockstep batch starting to drain), the few at B=61-63 slow: a fit with a
    per-sequence term would make a step dearer the fewer sequences it holds (here 0.14 s at B=6 against ~0.007 s
    measured) and push the controller to the deepest k in the drain. The B term needs batch sizes a factor of 2
    apart, and a fit whose step gets cheaper with more sequences or tokens falls back to a simpler one: at B=6 the
    prediction stays within the times seen. Where the sizes do span 2x but the fit is still unphysical (slow
    small-batch steps), it falls back as well."""
    from megatron_spec.spec.adaptive import least_squares, physical

    ctl = AdaptiveController(k_max=2)
    for _ in range(6):
        ctl.record_step(64, 1, 0.007)
        ctl.record_step(64, 2, 0.011)
    ctl.record_step(63, 1, 0.012)
    ctl.record_step(61, 1, 0.014)
    ctl.record_step(61, 1, 0.014)
    coef, row = ctl.fit_step()
    assert len(coef) == 2 and physical(coef)
    ctl._step_fit = (coef, row)
    assert 0.006 < ctl.t_step(6, 1) <= 0.014 and ctl.t_step(64, 2) > ctl.t_step(64, 1)
    wide = AdaptiveController(k_max=2)
    for _ in range(6):
        wide.record_step(64, 1, 0.007)
        wide.record_step(64, 2, 0.011)
        wide.record_step(8, 1, 0.012)
    coef, row = wide.fit_step()
    assert physical(coef) and len(coef) < 3
    obs = [(b, t, s) for t, window in wide.step_obs.items() for b, s in window]
    assert not physical(least_squares([(1.0, b * t, b) for b, t, _ in obs], [s for *_, s in obs]))  # with B: unphysical


def test_adaptive_untried_k_shares_plain_decodings_correction():
    """The model prices k=1 at 0.95x plain (a verify step 1.52x as dear, 1.45 tokens), so plain decoding. Plain steps
    then run at 0.79 of the predicted rate, as in a slower spell of the host, and k=1 has no outcomes: it takes
    plain decoding's correction instead of none, and the choice stays plain. Left uncorrected, k=1 would look 1.21x
    plain and win (the kind of choice that lost 27 % of a rollout). Once k=1 has outcomes of its own, they rule. A
    plain decoding faster than the model predicts lends an untried k nothing."""
    from megatron_spec.spec.adaptive import CORRECTION_MIN

    ctl = AdaptiveController(k_max=1)
    for b in (8, 64):
        for _ in range(3):
            for t in (1, 2):
                ctl.record_step(b, t, 0.0001 * b * (1 + 0.52 * (t - 1)))
    ctl.record_draft(64, 1, 0.0)
    ctl.record_draft(64, 1, 0.0)
    ctl.accept[:] = 0.45
    ctl.refresh_fits()
    rates = ctl.rates(64)
    assert rates[1] / rates[0] == pytest.approx(1.45 / 1.52, rel=1e-3) and ctl.best_k(64) == 0

    def outcome(batch, k, ratio):
        ctl.record_outcome(batch, k, 10, 10 / (ratio * ctl.rate(batch, k)))

    for _ in range(CORRECTION_MIN + 1):  # the first of a shape is dropped
        outcome(64, 0, 0.79)
    assert ctl.correction(64, 1) == ctl.correction(64, 0) == pytest.approx(0.79)
    assert ctl.correction(8, 1) == 1.0  # another octave: no outcomes there
    assert ctl.best_k(64) == 0
    for _ in range(CORRECTION_MIN + 1):
        outcome(64, 1, 1.0)
    assert ctl.correction(64, 1) == pytest.approx(1.0) and ctl.best_k(64) == 1
    for _ in range(CORRECTION_MIN + 1):  # plain faster than the model at B=8: no boost for k=1, untried there
        outcome(8, 0, 1.3)
    assert ctl.correction(8, 0) == pytest.approx(1.3) and ctl.correction(8, 1) == 1.0


def test_adaptive_tries_one_k_deeper_only_where_speculation_pays():
    """The fitted costs (a step 4 ms + 0.1 ms a row) and acceptances 0.9 / 0.5 / 0.5 make k=1 the best choice at
    B=64 (7.24 tokens/ms against 6.48 for k=2 and 6.15 plain), but a fit linear in rows can underprice a deep
    verify on a CPU, and k=2 without outcomes would never be tried. So the first decision tries k=2 for
    TRIAL_STEPS steps on the whole octave (B=40 too), then k=1 returns; once k=2's steps ran 1.3x faster than
    predicted (CORRECTION_MIN outcomes after the first of its shape), k=2 is chosen. No second trial in the octave
    within a probe period. Where speculation loses (acceptance 0.1: plain decoding is the choice) nothing deeper is
    ever tried, so a setting where speculation cannot pay keeps paying nothing for the trials."""
    from megatron_spec.spec.adaptive import CORRECTION_MIN, PROBE_STEPS, TRIAL_STEPS

    def controller(accept):
        ctl = AdaptiveController(k_max=3)
        for b in (32, 64):
            for t in (1, 2, 3, 4):
                for _ in range(3):
                    ctl.record_step(b, t, 0.004 + 0.0001 * b * t)
        ctl.record_draft(64, 1, 0.0)
        ctl.record_draft(64, 1, 0.0)
        ctl.accept[:] = accept
        return ctl

    ctl = controller([0.9, 0.5, 0.5])
    assert ctl.best_k(64) == 1
    trial = [ctl.choose_k(64 if i % 2 else 40) for i in range(TRIAL_STEPS)]
    assert trial == [2] * TRIAL_STEPS
    assert ctl.choose_k(64) == 1
    for _ in range(CORRECTION_MIN + 1):
        ctl.record_outcome(64, 2, 10, 10 / (1.3 * ctl.rate(64, 2)))
    assert ctl.best_k(64) == 2
    rest_of_period = [ctl.choose_k(64) for _ in range(ctl.probe_every - TRIAL_STEPS - PROBE_STEPS - 2)]
    assert rest_of_period[-1] == 2 and 3 not in rest_of_period  # k=2 decided; k=3 waits for the next period
    assert 3 in [ctl.choose_k(64) for _ in range(2 * ctl.decide_every + PROBE_STEPS)]
    ctl = controller([0.1, 0.1, 0.1])
    assert set(ctl.choose_k(64) for _ in range(3 * ctl.probe_every)) == {0}
