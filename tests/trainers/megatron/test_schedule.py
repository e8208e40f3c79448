"""One pipeline schedule call per train pass over micro-batches of different lengths (Megatron's
`variable_seq_lengths`), against one call per micro-batch shape, at PP2 (2 gloo ranks) and PP2 x EP2 (4).

Tolerances are `test_policy.py`'s (fp32, any CPU, 1 or 2 threads). The two paths run the same micro-batches
through the same layers with the same shapes, and 1F1B runs the backward passes in the forward order, so the
gradients accumulate in the same order too; what may differ is the router losses' scale (n / N restored by
`grad_scale_func` against 1 / N directly: one rounding, ~1e-7 relative). Observed: bitwise equal on a 2-core
AVX-512 EPYC at 1 thread. rel 1e-5 on loss, grad norm and clip fraction is far above that and far below a real
bug (a micro-batch's loss weighted 1 / 8 instead of 1 moves the loss by > 1e-2); weights after 2 Adam steps:
|diff| <= 2 x lr x steps, mean <= 1e-6.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import schedule_workers as w  # noqa: E402
from .test_policy import close_weights, same_metrics  # noqa: E402

pytestmark = pytest.mark.megatron_dist


@pytest.mark.parametrize("kind, layout, world, rows", [("moe", dict(pp=2), 2, 8),
                                                       ("dense", dict(pp=2), 2, 8),
                                                       ("moe", dict(pp=2, ep=2, etp=1), 4, 16)])
def test_one_schedule_call_per_pass_equals_a_call_per_shape(kind, layout, world, rows):
    """8 micro-batches per rank, each of another length (9-16 tokens): the one-call path makes 1 schedule call
    per train step where the per-shape path makes 8, reports the same padded share (each row padded only to
    itself at PP2: 0 pads; at PP2 x EP2 each slot pairs two rows of one length: 0 pads), and gives the same loss,
    grad norm, clip fraction and weights within the module's fp32 bounds, on every rank."""
    from megatron_spec.trainers.megatron.parallel import spawn

    for rank in spawn(w.one_vs_per_shape, world, kind, layout, rows):
        one, per_shape = rank["one"], rank["per_shape"]
        assert one["micro_batches"] == per_shape["micro_batches"] == 8
        for a, b in zip(per_shape["metrics"], one["metrics"]):
            same_metrics(a, b)
            assert (b["train_schedule_calls"], a["train_schedule_calls"]) == (1, 8)
            assert a["train_pad_fraction"] == b["train_pad_fraction"] == 0.0
        for a, b in zip(per_shape["weights"], one["weights"]):
            close_weights(a, b)

