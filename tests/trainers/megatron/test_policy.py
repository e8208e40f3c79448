"""`MegatronPolicy` (Megatron-Core trains the policy) against the embedded trainer and against itself across layouts.

One process (the TP1 references, MTP coupling, online MTP) and one pair of gloo ranks (TP2, PP2, EP2, resume) run
every scenario once (`policy_workers`); each test checks one part. Tiny models of `common.py`, fp32, 2 steps of
lr 1e-3 on 4 rows x 12 tokens; step 1 carries old log-probs away from the policy's so ratios and the clip matter.

Tolerances (fp32, any CPU, 1 or 2 threads):
- loss, clip fraction, grad norm: rel 1e-5. The same sums in a different order (TP splits matmuls, EP dispatches
  tokens, Megatron's fused QKV vs separate projections) differ by a few ulps of fp32 (~1e-7 relative) per op;
  over 2 layers and a softmax 1e-5 is >10x the observed gap (<= 8e-8 relative) and far below any real bug (a wrong
  denominator, a missed reduction or a double-counted shard moves these by >= 1e-2).
- weights after the updates: Adam's first steps move each weight by about lr x sign(grad), so an element whose
  gradient is ~0 can move by up to lr the other way when its gradient's rounding differs: |diff| <= 2 x lr x steps
  is the worst case; and the mean |diff| must stay below 1e-6 (observed <= 3e-8 for TP2), which no element-wise
  bug passes (a wrong gradient moves most elements by ~lr = 1e-3).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import policy_workers as w  # noqa: E402
from .common import tiny  # noqa: E402

pytestmark = pytest.mark.megatron_dist

REL = 1e-5
W_MAX = 2 * 1e-3 * w.STEPS
W_MEAN = 1e-6


@pytest.fixture(scope="module")
def one():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.one_rank, 1)[0]


@pytest.fixture(scope="module")
def two():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.two_ranks, 2)


@pytest.fixture(scope="module")
def embedded():
    return {kind: w.embedded_run(kind) for kind in ("dense", "moe")}


def same_metrics(a: dict, b: dict, keys=("loss", "grad_norm", "clip_frac")):
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=REL, abs=1e-7), k
    assert a["skipped"] is b["skipped"] is False


def close_weights(a: dict, b: dict, names=None):
    names = sorted(names or b)
    assert set(names) <= set(a), sorted(set(names) - set(a))[:3]
    diffs = torch.cat([(a[n].float() - b[n].float()).abs().flatten() for n in names])
    assert diffs.max() <= W_MAX and diffs.mean() <= W_MEAN, (float(diffs.max()), float(diffs.mean()))


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mtp", [None, "detached"])
def test_tp1_step_equals_the_embedded_trainer(one, embedded, kind, mtp):
    """Same weights and batches: loss (GRPO + MoE load-balancing), clip fraction, grad norm and the policy's
    weights after each update equal the embedded trainer's; with a detached MTP head the policy update is the one
    without it (the MTP layers are extra tensors in the export)."""
    ours, ref = one[kind, mtp, "tp1"], embedded[kind]
    for step in range(w.STEPS):
        same_metrics(ours["metrics"][step], ref["metrics"][step])
        close_weights(ours["weights"][step], ref["weights"][step])
    assert any(n.startswith("drafter.mtp.layers.0.") for n in ours["weights"][0]) == (mtp is not None)


LAYOUTS = [(kind, mtp, name) for (kind, mtp), names in w.TWO_RANK_LAYOUTS.items() for name in names]


@pytest.mark.parametrize("kind, mtp, layout", LAYOUTS)
def test_parallel_steps_equal_the_tp1_step(one, two, kind, mtp, layout):
    """TP2 / PP2 / EP2 on 2 gloo ranks: the same metrics and exported weights (policy and MTP head) as TP1, on
    every rank."""
    ref = one[kind, mtp, "tp1"]
    for rank in two:
        ours = rank[kind, mtp, layout]
        for step in range(w.STEPS):
            same_metrics(ours["metrics"][step], ref["metrics"][step])
            close_weights(ours["weights"][step], ref["weights"][step])
            assert sorted(ours["weights"][step]) == sorted(ref["weights"][step])
            if mtp:
                assert ours["metrics"][step]["drafter_loss"] == pytest.approx(ref["metrics"][step]["drafter_loss"],
                                                                              rel=REL)


@pytest.fixture(scope="module")
def embedded_correction():
    return w.embedded_correction_run("dense")


@pytest.mark.parametrize("layout", ["tp1", "dp2", "pp2"])
def test_corrected_step_with_left_out_rows_equals_the_embedded_step_without_them(one, two, embedded_correction,
                                                                              layout):
    """Async rollouts under dynamic sampling on the Megatron trainer: behaviour log-probs 0.5 x N(0, 1) off the
    policy's, geometric-mean ratios truncated at 1.2 (`grpo.rollout_correction`), and rows 2 and 3 left out with an
    empty mask (`loop.leave_out_rows`, as the loop leaves a group out of a fixed row count). Loss, clip fraction,
    truncated share, grad norm and weights equal the embedded trainer's step on rows 0 and 1 alone, at TP1, at DP2
    (rank 1's rows are the left-out ones: it contributes no token) and at PP2. Tolerances of the module docstring;
    the truncated share is a count over tokens, equal exactly (no ratio is within 1e-3 of the bound). The
    correction is live: the step without behaviour log-probs has another loss."""
    ref = embedded_correction["corrected"]
    runs = [one["correction"]] if layout == "tp1" else [rank["correction", layout] for rank in two]
    for ours in runs:
        same_metrics(ours["metrics"][0], ref["metrics"][0])
        assert ours["metrics"][0]["is_clip_frac"] == ref["metrics"][0]["is_clip_frac"]
        close_weights(ours["weights"][0], ref["weights"][0])
    assert 0 < ref["metrics"][0]["is_clip_frac"] < 1
    assert abs(ref["metrics"][0]["loss"] - embedded_correction["plain"]["metrics"][0]["loss"]) > 1e-3


def test_a_backward_outside_the_schedule_leaves_the_next_steps_as_they_were(one):
    """A backward through MoE routers outside Megatron's schedule (a detached MTP loss, as the GPU tier's MTP-only
    test runs before the GRPO-step test in one process) used to make the next schedule fail ("output with shape []
    doesn't match the broadcast shape [1]"): the steps after it now equal the TP1 steps of a process without it."""
    ours, ref = one["after_outside_backward"], one["moe", None, "tp1"]
    for step in range(w.STEPS):
        same_metrics(ours["metrics"][step], ref["metrics"][step])
        close_weights(ours["weights"][step], ref["weights"][step])


def test_detached_mtp_leaves_the_trunk_gradients_bitwise_unchanged(one):
    c = one["coupling"]
    assert sorted(c["detached"]["grads"]) == sorted(c["none"]["grads"])
    different = [n for n, g in c["none"]["grads"].items() if not torch.equal(g, c["detached"]["grads"][n])]
    assert not different, different[:3]
    assert c["detached"]["metrics"]["drafter_loss"] > 0


def test_coupled_mtp_adds_the_mtp_loss_gradient_to_the_trunk(one):
    """coupled - none == the gradient of the MTP loss alone (a coupled step with zero advantages, so the GRPO
    loss has none), within fp32 rounding of two summed gradients (1e-6 absolute; they are ~1e-3); and it is not 0."""
    c = one["coupling"]
    moved = 0.0
    for n, g in c["none"]["grads"].items():
        delta = c["coupled"]["grads"][n] - g
        torch.testing.assert_close(delta, c["coupled_mtp_only"]["grads"][n], rtol=0, atol=1e-6, msg=n)
        moved = max(moved, float(delta.abs().max()))
    assert moved > 1e-4  # the embedding, head and trunk all receive the MTP loss


def test_a_fresh_mtp_head_learns_online(one):
    """Qwen3 ships no MTP head: a new one (the trunk's last layer's kind, train-drafter's init) trained online on
    the same batch with lr 3e-3; its loss falls at every step (deterministic: fixed weights and batch)."""
    losses = one["online"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.01


@pytest.mark.parametrize("resumed", ["same_layout", "other_layout"])
def test_resume_across_layouts_equals_a_straight_run(two, resumed):
    """4 steps at EP2 vs 2 steps at EP2, a checkpoint (full HF tensors of weights and Adam moments), then 2 steps at
    EP2 again (bitwise) or at PP2 (same tolerances as a layout change)."""
    for rank in two:
        straight, resumed_run = rank["resume", "straight"], rank["resume", resumed]
        for step in range(2):
            a, b = resumed_run["metrics"][step], straight["metrics"][2 + step]
            if resumed == "same_layout":  # every figure but the processes' memory peaks
                assert {k: v for k, v in a.items() if k != "memory"} == {k: v for k, v in b.items() if k != "memory"}
                wa, wb = resumed_run["weights"][step], straight["weights"][2 + step]
                assert all(torch.equal(wa[n], wb[n]) for n in wb)
            else:
                same_metrics(a, b)
                close_weights(resumed_run["weights"][step], straight["weights"][2 + step])


def test_bad_layouts_fail_before_any_rank_allocates():
    """Checked against the model and the world before the process group or a parameter exists."""
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny("moe")
    cases = [(Parallelism(ep=3, etp=1), "ep=3 does not divide num_experts=4"),
             (Parallelism(ep=8, etp=1), "ep=8 does not divide num_experts=4"),
             (Parallelism(tp=3), "tp=3 does not divide num_attention_heads=4"),
             (Parallelism(pp=3), "pp=3 exceeds num_hidden_layers=2"),
             (Parallelism(tp=2), r"TP\*PP\*CP = 2 does not divide the 1 devices")]
    for par, message in cases:
        with pytest.raises(ValueError, match=message):
            MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, par)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="the MTP drafter has 1 layer"):
        MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, Parallelism(), drafter=w.our_drafter(cfg),
                       mtp_num_layers=2)
    assert not dist.is_initialized()
