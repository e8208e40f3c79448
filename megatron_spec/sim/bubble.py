"""The pipeline bubble of Megatron's schedules, as a factor on the ideal (all stages busy) train time.

1F1B over m micro-batches on pp stages takes (m + pp - 1) micro-batch slots of one stage's forward + backward,
m of them useful: the first micro-batch's forward reaches the last stage after pp - 1 slots and the last
backward drains back as long. Interleaved (v virtual stages per rank, each 1/v of the rank's layers) fills and
drains in (pp - 1) / v slots. A trainer that splits one pass into several schedule calls pays the fill and drain
once per call, so c calls over m micro-batches take m + c (pp - 1) / v slots.
"""

from __future__ import annotations


def bubble_factor(micro_batches: int, pp: int, vpp: int = 1, calls: int = 1) -> float:
    """Slots taken over slots of work: (m + calls x (pp - 1) / vpp) / m."""
    if micro_batches < 1 or pp < 1 or vpp < 1 or not 1 <= calls <= micro_batches:
        raise ValueError(f"need micro_batches >= 1, pp >= 1, vpp >= 1 and 1 <= calls <= micro_batches, got "
                         f"{micro_batches}, {pp}, {vpp}, {calls}")
    return (micro_batches + calls * (pp - 1) / vpp) / micro_batches


def pipeline_train_time(one_stage_s: float, pp: int, micro_batches: int, vpp: int = 1, calls: int = 1) -> float:
    """Seconds of a pass whose whole model takes `one_stage_s` on one stage, split evenly over `pp` stages."""
    return one_stage_s / pp * bubble_factor(micro_batches, pp, vpp, calls)
