"""`UniformStreams` (one array for a batch's per-sequence streams) against the per-sequence blocks it replaces, and
`PositionUniforms` (each output position's own uniform) against the same reference taken one value at a time."""

import random

import numpy as np
import torch

from megatron_spec.engine.sequence import Sequence, draw_seed
from megatron_spec.speculative.sampling import UNIFORM_BLOCK, PositionUniforms, UniformStreams, position_uniforms, uniforms


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
    """A sequence made without a stream gets its own, seeded with `draw_seed` of its generator's seed, and
    `Sequence.uniforms` follows the reference as well."""
    seq, ref = Sequence(0, [1], 10, torch.Generator().manual_seed(7)), Reference(draw_seed(7))
    for n in [1, 3, 255, 2, 300, 1]:
        assert seq.uniforms(n) == [float(np.float32(x)) for x in ref.take(n)]


def test_position_uniforms_depend_on_the_position_only():
    """Two tables over the same 6 generators, read with different patterns (one position at a time in order, as
    plain decoding does, against random runs of 1-9 positions from random starts, re-reading and skipping, as
    verify steps with rollbacks do, in random subsets of rows): every value at (row, position) is the same in both
    and equals the reference stream taken one value at a time, past several blocks. A lone sequence reads its own
    table at its next output position, and its in-order stream is not its position uniforms at any shift of up to
    400 (at most 2 of ~800 aligned float32 values equal by chance, where a shared stream would match them all)."""
    rng = random.Random(1)
    N, L = 6, 3 * UNIFORM_BLOCK + 40
    refs = [Reference(seed) for seed in range(N)]
    want = np.asarray([[ref.take(1)[0] for _ in range(L)] for ref in refs], dtype=np.float32)
    in_order = PositionUniforms([torch.Generator().manual_seed(seed) for seed in range(N)])
    got = np.stack([in_order.at(np.arange(N), np.full(N, t), 1)[:, 0] for t in range(L)], 1)
    assert np.array_equal(got, want)
    jumping = PositionUniforms([torch.Generator().manual_seed(seed) for seed in range(N)])
    for _ in range(2000):
        rows = np.array(rng.sample(range(N), rng.randint(1, N)))
        n = rng.randint(1, 9)
        starts = np.array([rng.randint(0, L - n) for _ in rows])
        assert np.array_equal(jumping.at(rows, starts, n), want[rows[:, None], starts[:, None] + np.arange(n)])
    seqs = [Sequence(i, [1], L, torch.Generator().manual_seed(i)) for i in range(2)]
    for seq in seqs:
        seq.output = [0] * 5
        assert position_uniforms([seq], 3).tolist() == [want[seq.index, 5:8].tolist()]
        draws = np.asarray(seq.uniforms(L), dtype=np.float32)
        assert max(int((draws[max(d, 0) : L + min(d, 0)] == want[seq.index, max(-d, 0) : L - max(d, 0)]).sum())
                   for d in range(-400, 401)) <= 2
