"""Validation (a): the reference paper's speculative columns, predicted from its autoregressive columns.

Inputs: the AR stage times, the acceptance length at each k, and k. The unknown mean response length is solved
from the AR gen time (reference.py), so the speculative gen time is a prediction of the step model with the
shared GPU calibration. `forward_overhead_s` was set once on RL-Zero k=3 (calibration.py); the RL-Think column and
the k sweep are out-of-sample.
"""

import pytest

from megatron_spec.sim.acceptance import speedup_floor
from megatron_spec.sim.reference import (
    EAGER_PENALTY_8B_S, PAPER_AR_STAGES, PAPER_GEN_SPEEDUP, PAPER_SPEC_K3, PAPER_TAU, VLLM_MAX_CUDAGRAPH_TOKENS,
    ReferenceSetup, drafter_profile, graph_limit_check, infer_mean_length, k_sweep, predict_spec_run,
)


@pytest.fixture(scope="module")
def mean_lens():
    setup = ReferenceSetup()
    return {w: infer_mean_length(setup, PAPER_AR_STAGES[w]["gen"]) for w in ("think", "zero")}


@pytest.fixture(scope="module")
def sweeps(mean_lens):
    return {w: {k: predict_spec_run(PAPER_AR_STAGES[w], tau, k, mean_len=mean_lens[w]).gen_speedup
                for k, tau in PAPER_TAU[w].items()} for w in ("think", "zero")}


@pytest.fixture(scope="module")
def graph_checks(mean_lens):
    return {(w, k): graph_limit_check(w, k, mean_len=mean_lens[w]) for w in ("think", "zero") for k in (3, 5, 7)}


@pytest.mark.parametrize("workload", ["think", "zero"])
def test_spec_columns_within_ten_percent(workload):
    """Paper: gen 87.0 s (Think) / 56.6 s (Zero), total 137.4 s / 107.5 s at k=3 with tau 2.77 / 3.32."""
    pred = predict_spec_run(PAPER_AR_STAGES[workload], PAPER_TAU[workload][3], 3)
    ref = PAPER_SPEC_K3[workload]
    assert pred.stages["gen"] == pytest.approx(ref["gen"], rel=0.10)
    assert pred.total == pytest.approx(ref["total"], rel=0.10)
    # Speculation must not touch the training-side stages (drafter trained offline in the paper's runs).
    for stage in ("data", "logprob", "train"):
        assert pred.stages[stage] == PAPER_AR_STAGES[workload][stage]


def test_inferred_lengths_are_plausible(mean_lens):
    """The AR gen times imply thinking responses longer than from-base ones, both well under the 16k cap."""
    assert 1000 < mean_lens["zero"] < mean_lens["think"] < ReferenceSetup().max_tokens / 2


def test_k3_is_the_best_of_the_sweep(sweeps):
    """Paper: k=3 is best for both workloads (Zero 1.77 > 1.44 > 1.21; Think 1.53 > 0.84 > 0.71). The model
    agrees on the order, and RL-Think's k=7 falls at least 15 % below its k=3."""
    for w in ("think", "zero"):
        s = sweeps[w]
        assert s[3] > s[5] > s[7], (w, s)
    assert sweeps["think"][7] < 0.85 * sweeps["think"][3]


def test_gains_shrink_faster_for_think(sweeps):
    """Think's acceptance grows less with k (2.77 -> 3.48) than Zero's (3.32 -> 5.06), so its speedup falls
    faster: S5/S3 and S7/S3 are lower for Think, as in the paper (0.55 / 0.46 vs 0.81 / 0.68)."""
    for k in (5, 7):
        assert sweeps["think"][k] / sweeps["think"][3] < sweeps["zero"][k] / sweeps["zero"][3]


def test_sweep_against_the_paper(sweeps):
    """Where the model stands against the paper's sweep, as numbers that fail if it moves.

    k=3 within 10 % for both workloads (the speculative columns). RL-Zero k=5 / k=7 are the known miss: the paper's
    1.44 / 1.21 sit on the tight linear floor (test_acceptance.py), which needs a verify pass that grows in
    proportion to its tokens from k=3 on; ours is bound by reading weights and KV at these batches and stays flat,
    so we are high by ~20 % / ~33 %: the test holds that miss under +25 % / +40 %. RL-Think below 1x at k=5 and 7
    is not reproduced (docs/design/simulator.md lists what was checked): the model stays above 1x there, on the linear
    side of the floor. A change that makes Think drop below 1x must come with a grounded super-linear mechanism,
    and then this test and the docs change together."""
    paper = PAPER_GEN_SPEEDUP
    for w in ("think", "zero"):
        assert sweeps[w][3] == pytest.approx(paper[w][3], rel=0.10), w
    assert 0 < sweeps["zero"][5] / paper["zero"][5] - 1 < 0.25
    assert 0 < sweeps["zero"][7] / paper["zero"][7] - 1 < 0.40
    assert sweeps["think"][5] > 1.0 and sweeps["think"][7] > 1.0


def test_model_respects_the_linear_cost_floor(sweeps):
    """Our per-step cost is a verify pass (rooflines of constant and token-linear terms, plus the per-forward
    overhead) and k draft forwards, so the sweep sits on or above the tight floor built from our own k_a speedup
    (acceptance.speedup_floor with speedup_a) -- the floor the paper's RL-Think k=3 -> 5 point breaks by 26 %."""
    for w in ("think", "zero"):
        taus, s = PAPER_TAU[w], sweeps[w]
        for ka, kb in ((3, 5), (5, 7), (3, 7)):
            assert s[kb] / s[ka] >= speedup_floor(taus[ka], taus[kb], ka, kb, speedup_a=s[ka]) - 1e-9, (w, ka, kb)


def test_cuda_graph_limit_is_where_the_kink_is_but_too_small(graph_checks):
    """vLLM captures CUDA graphs up to 512 tokens by default (reference.VLLM_MAX_CUDAGRAPH_TOKENS); with 128 rollouts
    per engine a k=3 verify is exactly 4 x 128 = 512 tokens, so no step exceeds it at k=3 while k=5 / k=7 steps do
    whenever more than 85 / 64 sequences are in flight -- the kink sits where the floor analysis puts it.

    But closing the gap to the paper would take +74 / +71 ms (Think) and +26 / +39 ms (Zero) per step over the
    limit: not one constant (Think needs about twice Zero's), and 6-17x the largest published cost of an 8B forward
    without graphs (2.2 ms at batch 1, EAGER_PENALTY_8B_S) for the at most two forwards per step it hits (the verify
    and the drafter's first pass). So the capture limit cannot be the mechanism (docs/design/simulator.md)."""
    for w in ("think", "zero"):
        assert graph_checks[(w, 3)].steps_over == 0
        for k in (5, 7):
            c = graph_checks[(w, k)]
            assert 0.05 * c.steps < c.steps_over < 0.3 * c.steps, (w, k)
            assert c.needed_s_per_step_over > 5 * 2 * EAGER_PENALTY_8B_S, (w, k)
    assert VLLM_MAX_CUDAGRAPH_TOKENS == 4 * 128
    think, zero = graph_checks[("think", 5)], graph_checks[("zero", 5)]
    assert think.needed_s_per_step_over > 2 * zero.needed_s_per_step_over
    assert think.needed_s_per_step_over > 15 * 2 * EAGER_PENALTY_8B_S


def test_kv_cache_is_far_from_full(graph_checks):
    """KV pressure cannot explain the sweep at the paper's setup: the busiest simulated run (RL-Think, k=7) fills
    under 55 % of an engine's cache (147 KB per token; ~580k tokens at gpu_memory_utilization 0.6), RL-Zero under
    40 %, so nothing is preempted; EAGLE's k lookahead slots per sequence add at most 7 x 128 tokens."""
    for (w, k), c in graph_checks.items():
        assert c.peak_kv_share < (0.55 if w == "think" else 0.40), (w, k, c.peak_kv_share)


def test_one_drafter_profile_gives_the_papers_acceptance_at_every_k(sweeps):
    """The sweep prices every k with one per-position profile, solved from the paper's three acceptance lengths
    (Think 0.758 x3, 0.642 x2, 0.781 x2; Zero 0.877 x3, 0.833 x2, 0.829 x2): each tau comes back exactly, so the
    profile moves no speed-up of the sweep (the per-k fit gives the same to 1e-6)."""
    for w in ("think", "zero"):
        profile = drafter_profile(w)
        for k, tau in PAPER_TAU[w].items():
            assert sum(_prod(profile[:i]) for i in range(k + 1)) == pytest.approx(tau, abs=1e-9)
    assert [round(a, 3) for a in drafter_profile("think")] == [0.758] * 3 + [0.642] * 2 + [0.781] * 2
    assert k_sweep("zero")[5] == pytest.approx(sweeps["zero"][5], abs=1e-6)


def _prod(xs):
    out = 1.0
    for x in xs:
        out *= x
    return out


def test_six_speedups_within_twenty_percent_are_out_of_reach_of_a_linear_cost():
    """Why the 20 % goal cannot be met for RL-Think k=5 while the k=3 gen stage stays within 10 %: S3 >= 1.53 / 1.1
    and the tight linear floor (acceptance.speedup_floor) give S5 >= 1.02, above the band's top 0.84 x 1.2 = 1.008.
    Every other point's band is reachable by a linear cost (Think k=7 >= 0.81 vs <= 0.85; Zero k=5 / 7 >= 1.33 /
    1.13 vs <= 1.73 / 1.45). Where the model stands: k=3 within 10 %, the four deeper points high (Zero k=5 by 21 %)."""
    think = PAPER_TAU["think"]
    s3 = PAPER_GEN_SPEEDUP["think"][3] / 1.1
    assert s3 * speedup_floor(think[3], think[5], 3, 5, speedup_a=s3) > 1.2 * PAPER_GEN_SPEEDUP["think"][5]
    for w, kb in (("think", 7), ("zero", 5), ("zero", 7)):
        taus, s3 = PAPER_TAU[w], PAPER_GEN_SPEEDUP[w][3] / 1.1
        assert s3 * speedup_floor(taus[3], taus[kb], 3, kb, speedup_a=s3) < 1.2 * PAPER_GEN_SPEEDUP[w][kb]


def test_validate_says_which_sweep_points_are_within_twenty_percent():
    """`simulate --validate` prints each k-sweep point's error and which are within the issue's 20 %: the two
    k=3 points; RL-Zero k=5 misses by 20.5 %, the RL-Think deep points by 74 % / 80 % (the linear-cost floor above
    says why no cost linear in k reaches RL-Think k=5)."""
    from megatron_spec.sim.report import validation_report

    out = validation_report()
    assert "within 20 % of the paper: 2 of 6 (think k=3, zero k=3)" in out
    assert "k=5: 1.73 / 1.44 (+20.5%)" in out and "k=5: 1.46 / 0.84 (+73.9%)" in out
