"""Acceptance arithmetic: the geometric formula, its inverse, per-position acceptance and the k-sweep floor."""

import pytest

from megatron_spec.sim.acceptance import (
    check_tau, rate_from_tau, speedup_floor, tau_from_positions, tau_from_rate,
)
from megatron_spec.sim.reference import PAPER_GEN_SPEEDUP, PAPER_TAU


def test_geometric_acceptance_length():
    """a = 0.5, k = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875 tokens per verify (Leviathan et al. 2023)."""
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


def test_floor_with_the_ar_cost_is_reached_by_a_kinked_linear_cost():
    """The tight floor is attained, so it cannot be raised: take a decode step of cost 1, a verify pass that costs
    exactly a decode at k_a = 3 and grows in proportion to its tokens from there (V(k) = (k+1)/4), and drafts
    that take the rest of C(3) = 2.5 (D = 0.5). Then C(5) = 1.5 + 2.5 = 4 and S = tau / C. Without the AR
    cost the floor is looser; with a speedup above tau it is an error (a verify never costs less than a decode)."""
    tau3, tau5 = 2.8, 3.6
    s3, s5 = tau3 / 2.5, tau5 / 4.0
    assert s5 / s3 == pytest.approx(speedup_floor(tau3, tau5, 3, 5, speedup_a=s3))
    assert speedup_floor(tau3, tau5, 3, 5) < speedup_floor(tau3, tau5, 3, 5, speedup_a=s3)
    with pytest.raises(ValueError, match="below the acceptance length"):
        speedup_floor(tau3, tau5, 3, 5, speedup_a=3.0)


def test_paper_sweep_against_the_linear_cost_floors():
    """What the paper's k sweep demands of any per-step cost at most linear in k (acceptance.speedup_floor).

    From the acceptance lengths alone only RL-Think k=3 -> 5 is impossible (0.55 against a floor of 0.70). With the
    paper's own AR cost (speedup_a) the floor tightens: RL-Think k=3 -> 5 is 26 % below it (0.55 vs 0.74), while
    RL-Zero's two steps sit on it (within 3 %, about the rounding of the published figures): Zero needs each extra
    drafted token to cost as much as a linear model allows -- a verify that costs a decode at k=3 and grows in
    proportion to its tokens from there, i.e. a kink at k=3. RL-Think 5 -> 7 is consistent with both. The test fails
    if the floors or the paper figures change (docs/design/simulator.md, "(a)")."""
    taus, speed = PAPER_TAU, PAPER_GEN_SPEEDUP

    def ratio_and_floors(w, ka, kb):
        t, s = taus[w], speed[w]
        return (s[kb] / s[ka], speedup_floor(t[ka], t[kb], ka, kb),
                speedup_floor(t[ka], t[kb], ka, kb, speedup_a=s[ka]))

    ratio, loose, tight = ratio_and_floors("think", 3, 5)
    assert ratio < 0.8 * loose and ratio < 0.75 * tight
    ratio, loose, tight = ratio_and_floors("think", 5, 7)
    assert ratio > tight > loose
    for ka, kb in ((3, 5), (5, 7)):
        ratio, loose, tight = ratio_and_floors("zero", ka, kb)
        assert loose < ratio and ratio == pytest.approx(tight, rel=0.03), (ka, kb, ratio, tight)


def test_per_position_from_taus_reproduces_every_measured_length():
    """The profile is solved segment by segment, so each given tau comes back to 1e-9; within a segment the
    conditional acceptance is constant, and a single measured k gives the constant rate of `rate_from_tau`."""
    from megatron_spec.sim.acceptance import per_position_from_taus

    taus = {3: 2.77, 5: 3.23, 7: 3.48}
    alphas = per_position_from_taus(taus)
    assert len(alphas) == 7
    for k, tau in taus.items():
        assert tau_from_positions(alphas, k) == pytest.approx(tau, abs=1e-9)
    assert alphas[0] == alphas[1] == alphas[2] and alphas[3] == alphas[4] and alphas[5] == alphas[6]
    assert per_position_from_taus({5: 4.0}) == pytest.approx((rate_from_tau(4.0, 5),) * 5, abs=1e-9)
    with pytest.raises(ValueError, match="grow with k"):
        per_position_from_taus({3: 2.8, 5: 2.7})
    with pytest.raises(ValueError, match="full acceptance"):
        per_position_from_taus({1: 1.5, 3: 3.5})
