"""Validation (a): the reference paper's speculative columns, predicted from its autoregressive columns.

Inputs: the AR stage times, the acceptance length at each k, and k. The unknown mean response length is solved
from the AR gen time (reference.py), so the speculative gen time is a prediction of the step model with the
shared GPU calibration. `forward_overhead_s` was set once on RL-Zero k=3 (calibration.py); the RL-Think column and
the k sweep are out-of-sample.
"""

import pytest

from megatron_spec.sim.acceptance import speedup_floor
from megatron_spec.sim.reference import (
    PAPER_AR_STAGES, PAPER_SPEC_K3, PAPER_TAU, ReferenceSetup, infer_mean_length, k_sweep, predict_spec_run,
)


@pytest.fixture(scope="module")
def sweeps():
    return {w: k_sweep(w) for w in ("think", "zero")}


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


def test_inferred_lengths_are_plausible():
    """The AR gen times imply thinking responses longer than from-base ones, both well under the 16k cap."""
    setup = ReferenceSetup()
    think = infer_mean_length(setup, PAPER_AR_STAGES["think"]["gen"])
    zero = infer_mean_length(setup, PAPER_AR_STAGES["zero"]["gen"])
    assert 1000 < zero < think < setup.max_tokens / 2


def test_k3_is_the_best_of_the_sweep(sweeps):
    """Paper: k=3 is best for both workloads (Zero 1.77 > 1.44 > 1.21; Think 1.53 > 0.84 > 0.71). The model
    agrees on the order; for Zero k=3 and k=5 are within a few percent (see README: the paper's drops are
    steeper than any per-step cost linear in k allows for Think)."""
    for w in ("think", "zero"):
        s = sweeps[w]
        assert s[3] > s[5] > s[7], (w, s)
    assert sweeps["think"][7] < 0.85 * sweeps["think"][3]


def test_gains_shrink_faster_for_think(sweeps):
    """Think's acceptance grows less with k (2.77 -> 3.48) than Zero's (3.32 -> 5.06), so its speedup falls
    faster: S7/S3 is lower for Think, as in the paper (0.46 vs 0.68)."""
    assert sweeps["think"][7] / sweeps["think"][3] < sweeps["zero"][7] / sweeps["zero"][3]


def test_model_respects_the_linear_cost_floor(sweeps):
    """Our per-step cost is a sum of terms at most linear in k, so our sweep sits on or above the floor the
    paper's RL-Think k=3 -> 5 point violates: S5/S3 >= floor. Below-1x Think at k=5 is therefore out of reach of
    any roofline that also gets k=3 right (README.md, 'What we cannot reproduce')."""
    for w in ("think", "zero"):
        taus, s = PAPER_TAU[w], sweeps[w]
        assert s[5] / s[3] >= speedup_floor(taus[3], taus[5], 3, 5) - 1e-9
        assert s[7] / s[5] >= speedup_floor(taus[5], taus[7], 5, 7) - 1e-9
