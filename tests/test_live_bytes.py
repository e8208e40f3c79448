"""The live-bytes counter the memory bounds use (`tests/live_bytes.py`): exact figures for a known sequence of
allocations, blocks from before the window left out."""

import torch

from .live_bytes import live_bytes


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
