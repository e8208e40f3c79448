"""`UniformStreams` (one array for a batch's per-sequence streams) against the per-sequence blocks it replaces."""

import random

import numpy as np
import torch

from megatron_spec.engine.sequence import Sequence
from megatron_spec.spec.sampling import UNIFORM_BLOCK, UniformStreams, uniforms


class Reference:
    """One sequence's stream as a list: blocks of max(UNIFORM_BLOCK, n) drawn when the rest is too short."""

    def __init__(self, seed):
        self.generator, self.block, self.next = torch.Generator().manual_seed(seed), [], 0

    def take(self, n):
        if self.next + n > len(self.block):
            self.block, self.next = torch.rand(max(UNIFORM_BLOCK, n), generator=self.generator).tolist(), 0
        self.next += n
        return self.block[self.next - n : self.next]


def test_batched_takes_equal_per_sequence_streams():
    """Random batches (subsets in any order) take random counts, including 0, a whole block and more than one,
    for 3000 takes: every value equals the reference stream's, rounded to float32 as the engine feeds it, and a
    sequence's values never depend on which others were in the batch."""
    rng = random.Random(0)
    N = 12
    refs = [Reference(seed) for seed in range(N)]
    stream = UniformStreams([torch.Generator().manual_seed(seed) for seed in range(N)])
    seqs = [Sequence(i, [1], 10, stream.generators[i], stream=stream, stream_row=i) for i in range(N)]
    for _ in range(3000):
        batch = rng.sample(range(N), rng.randint(1, N))
        n = rng.choice([0, 1, 1, 2, 4, 4, 7, 60, UNIFORM_BLOCK, UNIFORM_BLOCK + 3])
        got = uniforms([seqs[i] for i in batch], n)
        want = np.asarray([refs[i].take(n) for i in batch], dtype=np.float32).reshape(len(batch), n)
        assert got.dtype == np.float32 and np.array_equal(got, want)


def test_sequence_alone_draws_its_own_stream():
    """A sequence made without a stream gets its own, and `Sequence.uniforms` follows the reference as well."""
    seq, ref = Sequence(0, [1], 10, torch.Generator().manual_seed(7)), Reference(7)
    for n in [1, 3, 255, 2, 300, 1]:
        assert seq.uniforms(n) == [float(np.float32(x)) for x in ref.take(n)]
