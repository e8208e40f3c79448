"""Acceptance arithmetic: the geometric formula, its inverse, per-position acceptance and the k-sweep floor."""

import pytest

from megatron_spec.sim.acceptance import (
    check_tau, rate_from_tau, speedup_floor, tau_from_positions, tau_from_rate,
)
from megatron_spec.sim.reference import PAPER_GEN_SPEEDUP, PAPER_TAU


def test_geometric_acceptance_length():
    """a = 0.5, k = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875 tokens per verify (ANCHORS.md, Theory)."""
    assert tau_from_rate(0.5, 3) == pytest.approx(1.875)
    assert tau_from_rate(1.0, 5) == 6.0
    assert tau_from_rate(0.0, 7) == 1.0


@pytest.mark.parametrize("tau,k", [(2.77, 3), (3.32, 3), (4.35, 5), (5.06, 7), (1.0, 3), (4.0, 3)])
def test_rate_inverts_tau(tau, k):
    """Bisection recovers the per-token rate to 1e-9 in tau."""
    assert tau_from_rate(rate_from_tau(tau, k), k) == pytest.approx(tau, abs=1e-9)


def test_per_position_matches_geometric_when_constant():
    """Constant per-position acceptance reduces to the geometric sum; a decaying one gives less."""
    assert tau_from_positions([0.7] * 5) == pytest.approx(tau_from_rate(0.7, 5))
    assert tau_from_positions([0.9, 0.6, 0.3]) == pytest.approx(1 + 0.9 + 0.54 + 0.162)
    assert tau_from_positions([0.9, 0.6, 0.3], k=1) == pytest.approx(1.9)


def test_acceptance_length_above_k_plus_one_is_rejected():
    """A verify pass over k drafts emits at most k+1 tokens; the error names the constraint."""
    with pytest.raises(ValueError, match=r"exceeds k\+1 = 4"):
        check_tau(4.2, 3)
    with pytest.raises(ValueError, match="below 1"):
        check_tau(0.9, 3)


def test_paper_think_sweep_breaks_the_linear_cost_floor():
    """The paper's RL-Think k=3 -> 5 ratio (0.84 / 1.53 = 0.55) is below what any per-step cost growing at most
    linearly in k allows (0.70), while its other three steps are consistent. This is why no roofline reproduces
    RL-Think below 1x at k=5 (README.md): the test fails if the floor formula or the paper figures change."""
    for workload, expect_below in (("think", {(3, 5)}), ("zero", set())):
        taus, speed = PAPER_TAU[workload], PAPER_GEN_SPEEDUP[workload]
        for ka, kb in ((3, 5), (5, 7)):
            below = speed[kb] / speed[ka] < speedup_floor(taus[ka], taus[kb], ka, kb)
            assert below == ((ka, kb) in expect_below), (workload, ka, kb)
