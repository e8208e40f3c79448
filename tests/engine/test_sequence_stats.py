"""A sequence's speculation statistics, counted from its verify outcomes when read, against the per-step
incremental counting they replace, on random outcomes."""

import random

import torch

from megatron_spec.engine.sequence import Sequence


def incremental(outcomes):
    """(drafted, verify_steps, drafted_per_pos, accepted_per_pos) counted one verify step at a time."""
    drafted, steps, offered, stood = 0, 0, [], []
    for d, a in outcomes:
        drafted, steps = drafted + d, steps + 1
        if len(stood) < d:
            stood += [0] * (d - len(stood))
            offered += [0] * (d - len(offered))
        for i in range(d):
            offered[i] += 1
            stood[i] += i < a
    return drafted, steps, offered, stood


def test_statistics_equal_incremental_counting():
    """Random runs of verify steps with ragged draft counts (1..5 drafts, a drafted-less step never recorded)
    and any accepted count up to the drafts, including none at all."""
    rng = random.Random(0)
    for _ in range(300):
        seq = Sequence(0, [1], 10, torch.Generator())
        for _ in range(rng.randint(0, 30)):
            d = rng.randint(1, 5)
            seq.verify_outcomes.append((d, rng.randint(0, d)))
        got = (seq.drafted, seq.verify_steps, seq.drafted_per_pos, seq.accepted_per_pos)
        assert got == incremental(seq.verify_outcomes)
