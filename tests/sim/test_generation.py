"""The gen stage: a shrinking continuous batch with preemption, speculation and the adaptive controller."""

import pytest

from megatron_spec.models.presets import preset
from megatron_spec.sim.calibration import GPU
from megatron_spec.sim.config import LengthDist, Speculation
from megatron_spec.sim.generation import Engine, simulate_generation
from megatron_spec.sim.hardware import GPU_PROFILES
from megatron_spec.sim.shapes import drafter_shape, shape_of

M = preset("qwen3-8b")
ENGINE = Engine(shape_of(M), drafter_shape(M, "eagle3"), GPU_PROFILES["h100"], GPU, kv_capacity_tokens=2e6)


def test_steps_follow_the_longest_sequence():
    """Without speculation an engine takes exactly max-length steps; with acceptance length tau, max/tau."""
    lengths = [100.0, 400.0, 1000.0]
    ar = simulate_generation(ENGINE, 30, 50, lengths)
    sp = simulate_generation(ENGINE, 30, 50, lengths, Speculation(k=3, acceptance_length=2.5))
    assert ar.steps == pytest.approx(1000)
    assert sp.steps == pytest.approx(1000 / 2.5)
    assert ar.mean_batch == pytest.approx(30 * 1500 / 3 / 1000)  # sequence-steps / steps


def test_a_group_shares_its_prompts_prefill():
    """64 sequences, 8 to a prompt, admitted in one wave (no preemption): the prefill is that of the 8 prompts, the
    decode steps are those of 64 sequences either way. Fails where the share is dropped or applied to decoding."""
    lengths = [100.0, 400.0]
    alone = simulate_generation(ENGINE, 64, 500, lengths)
    shared = simulate_generation(ENGINE, 64, 500, lengths, prompt_share=8)
    assert alone.prefill_s == pytest.approx(ENGINE.prefill_time(64, 500))
    assert shared.prefill_s == pytest.approx(ENGINE.prefill_time(8, 500))
    assert shared.prefill_s < 0.5 * alone.prefill_s
    assert shared.time_s - shared.prefill_s == pytest.approx(alone.time_s - alone.prefill_s)


def test_long_tail_costs_more_than_its_tokens():
    """Same mean length, longer tail (sigma 1.2 vs 0.2): fewer tokens per step on average, so a slower step."""
    tight = LengthDist(mean=2000, max_tokens=16384, sigma=0.2).quantiles()
    tail = LengthDist(mean=2000, max_tokens=16384, sigma=1.2).quantiles()
    t_tight = simulate_generation(ENGINE, 256, 200, tight)
    t_tail = simulate_generation(ENGINE, 256, 200, tail)
    assert t_tail.time_s > 1.5 * t_tight.time_s
    assert t_tail.mean_batch < 0.5 * t_tight.mean_batch


def test_speculation_never_beats_the_acceptance_length():
    """A verify step costs at least a decode step at the same batch, so the gen speedup is below tau."""
    lengths = LengthDist(mean=1500, max_tokens=8192).quantiles()
    ar = simulate_generation(ENGINE, 64, 200, lengths).time_s
    for k, tau in ((1, 1.8), (3, 3.0), (5, 4.0), (7, 5.0)):
        sp = simulate_generation(ENGINE, 64, 200, lengths, Speculation(k=k, acceptance_length=tau)).time_s
        assert 1.0 < ar / sp < tau


def test_speculation_pays_less_at_large_batch():
    """Batch-aware speedup (MagicDec, TurboSpec): at 4 sequences verify is weight-bound and costs a decode step,
    so k=5, tau=4 gives ~1.75x (the 5 draft forwards, 1.8 ms each with the per-forward overhead, are what keep it
    below 4); at 1024 sequences of short context the 6-token verify is compute-bound and the same tau loses."""
    spec = Speculation(k=5, acceptance_length=4.0)
    lengths = [512.0] * 8

    def speedup(n):
        return simulate_generation(ENGINE, n, 64, lengths).time_s / simulate_generation(
            ENGINE, n, 64, lengths, spec).time_s

    assert speedup(4) > 1.5
    assert speedup(1024) < 0.6 * speedup(4)


def test_adaptive_controller_is_at_least_as_good_as_fixed_k():
    """The 'auto' controller picks, at every point of the run, the k' <= k that emits tokens fastest, so it
    cannot lose (beyond event granularity) to fixed k or to plain decoding."""
    lengths = LengthDist(mean=1000, max_tokens=8192, sigma=1.0).quantiles()
    n = 1024
    ar = simulate_generation(ENGINE, n, 64, lengths).time_s
    fixed = simulate_generation(ENGINE, n, 64, lengths, Speculation(k=7, acceptance_length=3.0)).time_s
    auto = simulate_generation(ENGINE, n, 64, lengths, Speculation(k=7, acceptance_length=3.0, adaptive=True))
    assert auto.time_s <= 1.01 * min(ar, fixed)
    assert 0 < auto.mean_k < 7


def test_full_cache_preempts_and_recomputes():
    """A KV cache of 100k tokens cannot hold 256 sequences growing to ~4k: vLLM-style preemption kicks in and the
    recompute prefills make the run slower than with a large cache."""
    lengths = [4000.0] * 8
    small = Engine(ENGINE.target, None, ENGINE.hw, GPU, kv_capacity_tokens=1e5)
    res = simulate_generation(small, 256, 100, lengths)
    big = simulate_generation(ENGINE, 256, 100, lengths)
    assert res.preempted > 0
    assert res.time_s > big.time_s
    with pytest.raises(ValueError, match="does not fit in memory"):
        simulate_generation(small, 4, 100, [200000.0])


def test_verify_cost_grows_with_its_positions_and_the_kv_length():
    """The verify forward over k+1 positions per sequence: at 256 sequences of 2k context its linear layers are
    compute-bound (256 x (k+1) tokens is past the ~230-token ridge of 8B weights on an H100 at these efficiencies),
    so each extra position adds time; the KV cache is read once per sequence whatever k, so context adds the same
    time to a decode step and to a verify."""
    n, ctx = 256, 256 * 2048
    verify = [ENGINE._fwd(ENGINE.target, n, k + 1, ctx) for k in (1, 3, 5, 7)]
    assert verify == sorted(verify) and verify[-1] > 1.5 * verify[0]
    decode = ENGINE._fwd(ENGINE.target, n, 1, ctx)
    assert verify[1] > decode
    more_kv = [ENGINE._fwd(ENGINE.target, n, q, 2 * ctx) - ENGINE._fwd(ENGINE.target, n, q, ctx) for q in (1, 4)]
    assert more_kv[0] > 0 and more_kv[1] == pytest.approx(more_kv[0], rel=0.01)


def test_the_drafter_runs_k_sequential_forwards():
    """A speculative step is one verify plus k draft forwards, one after another (each depends on the last), each
    paying the per-forward overhead; the first runs over every verified position (vLLM's padded drafter batch), so
    one more draft position adds one draft forward, one position to the first draft pass and one verify position."""
    n, ctx = 8, 8 * 1024
    for k in (2, 4, 6):
        step = ENGINE.step_time(n, ctx, k + 1, 2.0) - ENGINE.step_time(n, ctx, k, 2.0)
        draft = ENGINE._fwd(ENGINE.drafter, n, 1, ctx)
        first = ENGINE._fwd(ENGINE.drafter, n, k + 2, ctx) - ENGINE._fwd(ENGINE.drafter, n, k + 1, ctx)
        verify = ENGINE._fwd(ENGINE.target, n, k + 2, ctx) - ENGINE._fwd(ENGINE.target, n, k + 1, ctx)
        assert step == pytest.approx(draft + first + verify, rel=1e-9)
        assert draft > GPU.forward_overhead_s
