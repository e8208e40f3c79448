"""The live-bytes counter the memory bounds use (`tests/live_bytes.py`): exact figures for a known sequence of
allocations, blocks from before the window left out."""

import torch

from .live_bytes import LiveBytes, live_bytes


def test_counts_only_what_the_window_allocates_and_holds():
    """4 MiB and 8 MiB allocated, the 4 MiB freed, 2 MiB allocated: peak 12 MiB, 10 MiB still held at the end,
    14 MiB allocated in all; a block allocated before the window and freed inside it changes none of them."""
    earlier = torch.empty(1 << 20, dtype=torch.uint8)
    with live_bytes() as n:
        a = torch.empty(4 << 20, dtype=torch.uint8)
        b = torch.empty(8 << 20, dtype=torch.uint8)
        del a, earlier
        c = torch.empty(2 << 20, dtype=torch.uint8)
    assert (n.peak, n.end, n.allocated) == (12 << 20, 10 << 20, 14 << 20)
    del b, c


def test_events_of_one_timestamp_and_unrecorded_frees():
    """Events as the profiler's tree gives them, out of order: a block made and dropped within one nanosecond
    (its free listed first) counts for its nanosecond only; a block freed and its address handed out again in the
    same nanosecond counts once; a free of a block from before the window counts nothing; an address handed out
    again without a recorded free ends the block it had."""
    from .live_bytes import tally

    assert tally([(5, -16, 1), (5, 16, 1)]) == LiveBytes(peak=16, end=0, allocated=16)
    assert tally([(1, 100, 7), (2, 50, 7), (2, -100, 7)]) == LiveBytes(peak=100, end=50, allocated=150)
    assert tally([(1, -64, 3), (2, 10, 4)]) == LiveBytes(peak=10, end=10, allocated=10)
    assert tally([(1, 100, 7), (3, 30, 7), (2, 20, 8)]) == LiveBytes(peak=120, end=50, allocated=150)
