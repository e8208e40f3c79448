"""Speculative decoding in the engine: greedy identity for every drafter, sampled distributions equal to plain
decoding, exact logprobs, KV rollback, MTP/EAGLE-3 incremental drafting equal to drafting from scratch, and
bad input."""

import numpy as np
import pytest
import torch

from megatron_spec import kernels
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.models import CausalLM, preset
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.drafters.hidden import HiddenStateProposer
from megatron_spec.speculative.sampling import processed_logprobs

from ..engine.conftest import noisy_copy
from .hidden_reference import reference_hidden_drafts
from .stats import assert_rejects, chi2_quantile_999, homogeneity, noncentrality_homogeneity

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [3], [20, 21, 20, 21, 20], [40] * 6, [33, 34]]


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model


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


SAMPLED = [dict(temperature=1.0), dict(temperature=0.7, top_k=8), dict(temperature=1.0, top_p=0.8)]
"""The sampling settings of the chi-square tests (here and in tests/gpu)."""

COOL = 0.75
"""The engine-level power controls' error: plain decoding at 0.75 times the test's temperature. On the tiny target
(64 tokens, next-token distributions spread over ~30 of them) 2000 completions a side cannot see a 5 % temperature
error: lambda is 4.5 at T = 1 and 1.5 at T = 0.7, top-k 8 at the first position (power < 0.01), and 30000-60000 a
side would be needed; only under top-p 0.8 does the first position see it (power 1 - 1e-6: the nucleus's edge
moves). These tests catch errors of the control's size; test_verify.py's sampler-level tests catch a 5 % one."""


@pytest.mark.parametrize("kw", SAMPLED)
def test_sampled_completions_match_plain_decoding(target, kw):
    """2000 three-token completions of one prompt, plain vs speculative (noisy draft model, k=3, sampled drafts
    with their q in verification): for each of the three positions a two-sample chi-square test of the token
    frequencies, threshold the 99.9 % quantile (false alarm 0.001 per assertion, fixed seeds). Power control
    (`assert_matches_plain`): plain decoding at 0.75 times the temperature is rejected at each position."""
    assert_sampled_matches_plain(target, kw)


@pytest.mark.parametrize("kw", SAMPLED[:2])
def test_sampled_completions_with_greedy_drafts_match_plain_decoding(target, kw):
    """The same test with the draft model's argmax as its drafts (q one-hot), which on the CPU the engine verifies
    in one kernel call (`kernels.verify_coupled`; checked here by counting its calls): the path of the main job's
    MTP head. A draft stands with probability p(draft), and a rejection draws from p without it."""
    calls, fused = [], kernels.verify_coupled
    kernels.verify_coupled = lambda *args: calls.append(1) or fused(*args)
    try:
        assert_sampled_matches_plain(target, kw, draft_sampling=False)
    finally:
        kernels.verify_coupled = fused
    assert len(calls) >= 8  # at least one verify step for each of the 8 batches of 250 sequences


def test_sampled_completions_with_sampled_mtp_drafts_match_plain_decoding(target):
    """The same test for an MTP head that samples its drafts (q is the head's processed distribution): the
    hidden-state proposer's sampled path over the full vocabulary (EAGLE-3's, through a draft vocabulary, is
    test_hidden_draft_vocab.py's). An untrained head's q is far from p: 645 of 2000 drafts accepted here, so
    residual draws are frequent. Its power control is the T = 1 one of `assert_matches_plain` (power 1 - 1e-10,
    1 - 3e-6, 0.998 at positions 0, 1, 2)."""
    torch.manual_seed(3)
    head = MTP(target.config, MTPConfig(1))
    fast = assert_matches_plain(target, SAMPLED[0], SpecConfig("mtp", 3, draft_sampling=True), head)
    accepted, drafted = (sum(o.spec.get(key, 0) for o in fast) for key in ("accepted", "drafted"))
    assert 200 < accepted < drafted // 2


@pytest.mark.parametrize("name", ["ngram", "history", "draft_model", "mtp_2_layers", "eagle3", "ngram_adaptive"])
def test_sampled_tokens_with_deterministic_drafts_are_plain_decodings_for_the_same_seed(target, name):
    """Sampling at T = 0.5 with top-k 20 (cool enough for the n-gram drafters to find repeats), batch capacity 4 with 6 prompts: with every deterministic drafter the
    engine emits the plain engine's tokens and log-probs for the same seed, bit for bit, because each output
    position's token is drawn with that position's uniform by the same kernel in a plain and a verify step, from
    logits the CPU kernels compute the same in both. Drafts were made and some accepted (it is not plain decoding
    twice), and another seed gives other tokens (the equality is not of something the seed does not reach).

    This exact identity, not a chi-square test, is what covers sampling with the n-gram and history drafters and
    with MTP and EAGLE-3 heads drafting greedily (the draft model's greedy drafts have both): it has no false
    alarm and fails on one changed token, so it needs no power control."""
    spec, drafter = drafters(target)[name]
    params = SamplingParams(temperature=0.5, top_k=20, max_tokens=40, seed=4)
    plain = LLMEngine(target, max_num_seqs=4).generate(PROMPTS, params)
    fast = LLMEngine(target, max_num_seqs=4, spec=spec, drafter=drafter).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.logprobs for o in fast] == [o.logprobs for o in plain]
    assert sum(o.spec.get("accepted", 0) for o in fast) > 0
    other = LLMEngine(target, max_num_seqs=4).generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 5}))
    assert [o.token_ids for o in other] != [o.token_ids for o in plain]


def assert_sampled_matches_plain(target, kw: dict, draft_sampling: bool = True) -> None:
    """The body of `test_sampled_completions_match_plain_decoding`, for a target on any device (tests/gpu)."""
    spec = SpecConfig("draft_model", 3, draft_sampling=draft_sampling)
    fast = assert_matches_plain(target, kw, spec, noisy_copy(target, 0.005, 5))
    # Speculation really ran and was accepted (an argmax draft stands with probability p(argmax), which at T = 1 on
    # this target is lower than a sampled draft's min(1, p / q): 456 drafts accepted in all here).
    assert sum(o.spec.get("accepted", 0) for o in fast) > (1000 if draft_sampling else 400)


def assert_matches_plain(target, kw: dict, spec: SpecConfig, drafter, n: int = 2000) -> list:
    """n three-token completions of [5, 6, 7], plain (seed 17) and speculative (seed 18): at each position a
    two-sample chi-square test of the token counts at the 99.9 % quantile (false alarm 0.001 per position).

    Power control: n plain completions at `COOL` times the temperature (seed 19) against the same plain ones must
    be rejected at each position. The noncentral chi-square's power at n = 2000, from the exact marginal
    distributions of the three positions (enumerated over every prefix, a one-off), is >= 0.997 at each position
    for each of `SAMPLED`: at T = 1 1 - 1e-10, 1 - 3e-6, 0.998 (lambda 153, 134, 95 on df 26, 53, 56); at T = 0.7,
    top-k 8 0.997, 1 - 5e-8, 1 - 8e-6 (lambda 52, 123, 119 on df 7, 22, 41); at T = 1, top-p 0.8 1 - 1e-13 or
    more (lambda 318, 299, 239). The first position's is computed here from the target's distribution and must be
    >= 0.99. Returns the speculative completions."""
    prompt, vocab = [5, 6, 7], target.config.vocab_size
    cool = {**kw, "temperature": kw.get("temperature", 1.0) * COOL}

    def sample(spec_, drafter_, seed, params):
        engine = LLMEngine(target, max_num_seqs=250, spec=spec_, drafter=drafter_)
        return engine.generate([prompt] * n, SamplingParams(max_tokens=3, seed=seed, **params))

    plain, fast, control = sample(None, None, 17, kw), sample(spec, drafter, 18, kw), sample(None, None, 19, cool)
    with torch.no_grad():
        logits = target(torch.tensor([prompt], device=target.device))[0, -1].cpu()
    first = noncentrality_homogeneity(processed_logprobs(logits, **kw).exp().numpy(),
                                      processed_logprobs(logits, **cool).exp().numpy(), n, n)
    for pos in range(3):
        a, b, c = (np.bincount([o.token_ids[pos] for o in outs], minlength=vocab) for outs in (plain, fast, control))
        chi2, df = homogeneity(a, b)
        assert chi2 <= chi2_quantile_999(df)
        assert_rejects(*homogeneity(a, c), first if pos == 0 else None)
    return fast


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


@pytest.mark.parametrize("method,depths,max_pending", [("mtp", 2, 64 << 20), ("mtp", 2, 10_000), ("mtp", 1, 64 << 20),
                                                       ("eagle3", 1, 64 << 20), ("eagle3", 1, 10_000)])
def test_hidden_drafters_after_spans_without_speculation(target, method, depths, max_pending, monkeypatch):
    """A hidden-state drafter holds the target states of steps that do not speculate and writes them in one batch
    before its next draft (or once it holds `MAX_PENDING_BYTES`, here also a few steps' worth); a one-depth head
    right after a drafting step reads the verify forward's rows directly instead (`catch_up_rows`). Under a schedule
    of k with spans of plain steps, and sequences joining freed slots (6 prompts, 4 slots), every draft equals the
    one full forwards over the sequence give, and the greedy tokens equal plain decoding's. A state left unwritten,
    written to the wrong place or read from the wrong row of the verify forward changes the drafts, and so does a
    depth of a 2-layer MTP head left out of a round whose k is 1 (its keys would be missing from then on). Both
    routes must have run for a one-depth head, and a two-depth head must never take the direct one."""
    from itertools import cycle

    from megatron_spec.drafters import hidden
    from megatron_spec.drafters.hidden import write_rows

    monkeypatch.setattr(hidden, "MAX_PENDING_BYTES", max_pending)
    torch.manual_seed(7)
    head = MTP(target.config, MTPConfig(depths)) if method == "mtp" else Eagle3Head.from_target(target)
    head.reset_parameters(std=0.15)
    engine = LLMEngine(target, max_num_seqs=4, spec=SpecConfig(method, 3, adaptive=True), drafter=head)
    script = cycle([0, 0, 0, 0, 0, 2, 3, 0, 0, 1])
    engine.controller.choose_k = lambda batch: next(script)
    writes, routes, proposer = [], [], engine.proposer
    monkeypatch.setattr(hidden, "write_rows", lambda *a: (writes.append(1), write_rows(*a)))
    catch_up_rows = proposer.catch_up_rows

    def route(*args):  # "direct": the held forward was read without a write
        held, written = bool(proposer.pending), len(writes)
        rows = catch_up_rows(*args)
        routes.append("direct" if held and len(writes) == written else "written" if held else "none held")
        return rows

    proposer.catch_up_rows = route
    for tokens, drafts in incremental_drafts(engine, PROMPTS, 30):
        assert drafts == reference_hidden_drafts(target, head, tokens, len(drafts))[0]
    assert ("direct" in routes) == (depths == 1) and "written" in routes
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = LLMEngine(target, max_num_seqs=4).generate(PROMPTS, params)
    script = cycle([0, 0, 0, 0, 0, 2, 3, 0, 0, 1])
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in plain]


def test_feature_writes_apply_in_order():
    """`write_rows` applies several forwards' states (each as parts laid side by side, as EAGLE-3's captured layers
    are) in one copy; where two land on one (slot, position), as when a freed slot takes a new sequence while writes
    are held, the later one stands; padding positions are dropped."""
    from megatron_spec.drafters.hidden import write_rows

    buffer = torch.zeros(2, 4, 2)
    first = torch.arange(12.0).view(2, 3, 2)  # slots 0 and 1 from position 0; slot 1 has 1 valid position of 3
    second = torch.full((1, 2, 2), -1.0)  # slot 1 again, positions 0-1: overwrites the first write's position 0
    write_rows(buffer, [([0, 1], [0, 0], [3, 1], (first[..., :1], first[..., 1:])),
                        ([1], [0], [2], (second[..., :1], second[..., 1:]))])
    assert buffer[0, :3].tolist() == first[0].tolist() and buffer[0, 3].tolist() == [0, 0]
    assert buffer[1].tolist() == [[-1, -1], [-1, -1], [0, 0], [0, 0]]


def test_adaptive_times_catch_ups_but_not_plain_steps_after_drafting(target):
    """A draft right after a plain (or prefill) step includes the hidden-state drafter catching up over the positions
    it skipped: that is what switching to speculation costs, so it is timed with the speculative steps. A plain step
    right after a drafting one runs with the drafter's weights in cache (a draft model on the deep tiny target at
    B=8: 2 % slower than after a plain step, `research/shape_costs.py`), which is not what plain decoding costs,
    so it is not timed. With the choices 0, 1, 1, 0, 1, 2, 1, 0, 0 the controller gets the steps at k = 0, 1, 1,
    1, 2, 1 and 0: all but the two plain steps right after drafting, the two drafting steps after plain ones marked
    as catch-ups."""
    engine = LLMEngine(target, spec=SpecConfig("mtp", 2, adaptive=True), drafter=MTP(target.config))
    script = iter([0, 1, 1, 0, 1, 2, 1, 0, 0] + [0] * 64)
    engine.controller.choose_k = lambda batch: next(script)
    steps = []
    engine.controller.record_step = lambda batch, k, seconds, catch_up: steps.append((k, catch_up))
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert steps[:7] == [(0, False), (1, True), (1, False), (1, True), (2, False), (1, False), (0, False)]


