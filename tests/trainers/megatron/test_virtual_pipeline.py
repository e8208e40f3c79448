"""Interleaved virtual pipeline stages (`backend.megatron.virtual_pipeline`): PP2 x VP2 on a 4-layer policy, each
rank holding two chunks of one layer (rank 0 layers 0 and 2, rank 1 layers 1 and 3), and on 6 layers split 4 / 2,
trains as PP2 x VP1 and as one rank do; a sharded checkpoint moves between VP2 and VP1.

Tolerances are `test_policy.py`'s (fp32, any CPU, 1 or 2 threads). The three runs compute the same layers on the
same micro-batches; what differs is only where the sums happen: the interleaved schedule runs the backward passes
in another order than 1F1B (and than one rank's loop), so each parameter's gradient, a sum over 8 micro-batches,
is added up in another order: a few fp32 roundings, ~1e-7 relative. rel 1e-5 on loss, grad norm and clip fraction
is far above that and far below a real bug (a micro-batch dropped or counted twice moves the loss by > 1e-2, a
chunk's layer skipped changes the weights by far more than the bound); weights after 2 Adam steps:
|diff| <= 2 x lr x steps, mean <= 1e-6 (an Adam step moves a weight by about lr, whatever the gradient's size, so
these bounds admit rounding of the update's sign only where a gradient is ~0).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import vpp_workers as w  # noqa: E402
from .test_policy import close_weights, same_metrics  # noqa: E402



def test_interleaved_group_size():
    """Megatron-Core's interleaved schedule runs groups of g micro-batches per chunk, pp <= g <= M, the last group
    empty or at least pp long: the smallest such g (pp itself when pp divides M); fewer than pp micro-batches are
    refused with the fix named."""
    from megatron_spec.trainers.megatron.step import interleave_group

    assert [interleave_group(m, 2) for m in (2, 3, 4, 5, 7, 8)] == [2, 3, 2, 3, 4, 2]
    assert [interleave_group(m, 4) for m in (4, 5, 6, 9, 12)] == [4, 5, 6, 5, 4]
    with pytest.raises(ValueError, match="at least pp=4 micro-batches.*virtual_pipeline=1"):
        interleave_group(3, 4)


def test_packed_cut_leaves_pp_micro_batches_per_rank():
    """With interleaved stages the policy asks `plan` for at least pp micro-batches per rank: 8 rows of 8 lengths
    under a budget that would hold them all in one slot are cut into that many slots, longest rows first, each rank
    with the same slot shapes; without the floor the cut is unchanged (one slot)."""
    import torch

    from megatron_spec.trainers.megatron.step import slots
    from megatron_spec.interfaces import Batch

    mask = torch.zeros(8, 16, dtype=torch.bool)
    for i in range(8):
        mask[i, 4 : 5 + i] = True  # row i holds 5 + i positions
    batch = Batch(torch.zeros(8, 16, dtype=torch.long), mask, torch.zeros(8), None)
    assert slots(batch, 0, 1, 0) == [(list(range(8)), 12)]
    assert slots(batch, 0, 1, 0, 4) == [([6, 7], 12), ([4, 5], 10), ([2, 3], 8), ([0, 1], 6)]
    assert [slots(batch, 0, 2, r, 2) for r in (0, 1)] == [[([6, 7], 12), ([2, 3], 8)], [([4, 5], 12), ([0, 1], 8)]]


UNEVEN = dict(pp=2, first_stage_layers=4)
"""6 layers: 4 on the first stage, the even share (2) on the other."""


@pytest.mark.megatron_dist
@pytest.mark.parametrize("kind, layers, layout, pp_layers, vp_layers", [
    ("dense", 4, dict(pp=2), [[[0, 1]], [[2, 3]]], [[[0], [2]], [[1], [3]]]),
    ("tied", 4, dict(pp=2), [[[0, 1]], [[2, 3]]], [[[0], [2]], [[1], [3]]]),
    ("moe", 4, dict(pp=2), [[[0, 1]], [[2, 3]]], [[[0], [2]], [[1], [3]]]),
    ("dense", 6, UNEVEN, [[[0, 1, 2, 3]], [[4, 5]]], [[[0, 1], [3, 4]], [[2], [5]]]),
])
def test_interleaved_stages_train_as_one_stage_per_rank_and_one_rank(kind, layers, layout, pp_layers, vp_layers):
    """Each rank's chunks hold the layers Megatron-Core's interleaved layout gives them (uneven stages: each stage's
    layers in vp equal runs). `tied`: the head shares the embedding, so the first stage's first chunk and the
    last stage's last chunk hold the one weight and sum its gradient; `moe`: the router losses of layers on
    different chunks. Every run makes one schedule call per train pass (8 micro-batches of 8 lengths); loss
    (GRPO + router losses), grad norm, clip fraction and the exported weights after each step agree on every rank
    with PP2 x VP1 and with one rank. The refit by stages (`stage_buckets`) sends each tensor of the export once,
    from the rank whose chunk holds it."""
    from megatron_spec.trainers.megatron.parallel import spawn

    one = spawn(w.two_steps, 1, kind, dict(), layers)[0]
    pp = spawn(w.two_steps, 2, kind, layout, layers)
    vp = spawn(w.two_steps, 2, kind, dict(layout, vp=2), layers)
    assert [r["layers"] for r in pp] == pp_layers
    assert [r["layers"] for r in vp] == vp_layers
    for rank in range(2):
        for a, b, c in zip(one["metrics"], pp[rank]["metrics"], vp[rank]["metrics"], strict=True):
            same_metrics(a, c)
            same_metrics(b, c)
            assert b["train_schedule_calls"] == c["train_schedule_calls"] == 1
        for a, b, c in zip(one["weights"], pp[rank]["weights"], vp[rank]["weights"], strict=True):
            assert set(c) == set(a)
            close_weights(a, c)
            close_weights(b, c)
    # The refit by stages: each rank sends its chunks' tensors, together the whole export, bit for bit.
    stages = [r["stage"] for r in vp]
    assert not set(stages[0]) & set(stages[1]) and set(stages[0]) | set(stages[1]) == set(vp[0]["weights"][-1])
    for share in stages:
        assert all(t.equal(vp[0]["weights"][-1][n]) for n, t in share.items())


@pytest.mark.megatron_dist
@pytest.mark.parametrize("saved_at, loaded_at", [(dict(pp=2, vp=2), dict(pp=2)), (dict(pp=2), dict(pp=2, vp=2))])
def test_sharded_checkpoint_moves_between_virtual_pipeline_layouts(tmp_path, saved_at, loaded_at):
    """A sharded checkpoint (fp32 masters, both Adam moments, the step) saved after step 1 at one layout and loaded
    at the other continues as the run that never stopped: steps 2 and 3 give its loss, grad norm, clip fraction
    and weights within the module's bounds (the layouts differ only in the order gradients are summed). A moment
    or a layer's weights loaded into the wrong chunk would move the next Adam step by about lr per weight, far
    outside the weight bound's mean."""
    from megatron_spec.trainers.megatron.parallel import spawn

    for rank in spawn(w.resumed, 2, str(tmp_path), "dense", saved_at, loaded_at):
        straight, resumed = rank["straight"], rank["resumed"]
        for a, b in zip(straight["metrics"][1:], resumed["metrics"], strict=True):
            same_metrics(a, b)
        close_weights(straight["weights"], resumed["weights"])
