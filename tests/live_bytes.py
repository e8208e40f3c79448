"""Live tensor bytes, counted by torch's own CPU allocator: a memory figure that does not depend on what the process
did before.

A process's resident set (RSS) is what the kernel maps for it, so it also counts what malloc keeps of memory freed
earlier (glibc keeps freed blocks in its heap, and its mmap threshold rises after a large free, so the next
allocations of that size land in the heap instead of fresh mappings): the same code peaks higher or lower by
several MiB depending on what ran before it in the process and on the machine. `LiveBytes` counts instead what
torch's CPU allocator hands out and takes back: under `torch.profiler.profile(profile_memory=True)` every
allocation and free of a tensor's storage is recorded with its pointer and size. Only the blocks allocated inside
the window are counted (a free is matched to its allocation by pointer), so the figures are the bytes the code
under measurement allocated and still held at each moment: the same on every run, machine and thread count for
the same tensor shapes. The profiler follows the thread that opened the window, which is the one that allocates
the tensors (torch's intra-op threads compute into buffers allocated before they start; gloo sends and receives
in the tensors it is given). A block whose last reference another thread drops is freed unrecorded: gloo's
worker thread lets go of a collective's tensors just after the caller's `wait()` returns, so a buffer the caller
drops at once (the weight group's payload at the end of a send, a pooled gather buffer replaced by a larger one)
may be freed there, and would count as live until its address is handed out again. `gloo_lets_go` closes that
gap: the caller of each broadcast (and all-reduce: the weight group's opening mark) goes on only once gloo holds
none of its tensors, so every free is the caller's, and recorded.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from itertools import groupby
from dataclasses import dataclass


@dataclass
class LiveBytes:
    """Figures of one window: `peak`, the most bytes allocated in the window that were live at once; `end`, those
    still live when it closed; `allocated`, all bytes allocated in it (freed or not)."""

    peak: int = 0
    end: int = 0
    allocated: int = 0


@contextmanager
def live_bytes():
    """Count the CPU tensor bytes allocated and freed inside the `with` block; the `LiveBytes` it yields is filled
    in when the block ends."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    out = LiveBytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events = []

    def walk(nodes):
        for e in nodes:
            if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    figures = tally(events)
    out.peak, out.end, out.allocated = figures.peak, figures.end, figures.allocated


def tally(events: list[tuple[int, int, int]]) -> LiveBytes:
    """The figures of allocator events `(time_ns, bytes (negative: freed), address)`, in any order."""
    out = LiveBytes()
    live: dict[int, int] = {}
    current = 0

    def free(ptr):
        nonlocal current
        current -= live.pop(ptr)

    for _, same_time in groupby(sorted(events), key=lambda e: e[0]):
        # The tree does not keep the order of events with one timestamp (a small tensor made and dropped within
        # a nanosecond): frees of blocks live before go first, then allocations, then frees of those.
        same_time = [(size, ptr) for _, size, ptr in same_time]
        later = []
        for size, ptr in same_time:
            if size < 0:
                if ptr in live:
                    free(ptr)
                else:  # allocated at this same time, or before the window (then not counted)
                    later.append(ptr)
        for size, ptr in same_time:
            if size > 0:
                current += size - live.get(ptr, 0)  # an address handed out again was freed, if unrecorded
                live[ptr] = size
                out.allocated += size
                out.peak = max(out.peak, current)
        for ptr in later:
            if ptr in live:
                free(ptr)
    out.end = current
    return out


@contextmanager
def gloo_lets_go(*holders):
    """Inside the block, `torch.distributed.broadcast` and the `broadcast` and `allreduce` of each holder's process
    groups (`.pg` and `.pgs`: a weight group's) return only once no other thread holds a reference to the tensors they were given (their
    use counts are back to what they were before the call). Changes what runs when, never what is allocated."""
    import torch.distributed as dist

    def settle(tensors, counts):
        deadline = time.monotonic() + 60
        while any(t._use_count() > n for t, n in zip(tensors, counts)):
            if time.monotonic() > deadline:
                raise RuntimeError("gloo still holds a broadcast's tensor 60 s after it completed")
            time.sleep(1e-4)

    class Work:
        def __init__(self, work, tensors, counts):
            self.work, self.tensors, self.counts = work, tensors, counts

        def wait(self):
            done, self.work = self.work.wait(), None
            settle(self.tensors, self.counts)
            return done

    class Group:
        def __init__(self, pg):
            self.pg = pg

        def broadcast(self, tensors, *args):
            counts = [t._use_count() for t in tensors]
            return Work(self.pg.broadcast(tensors, *args), tensors, counts)

        def allreduce(self, tensors, *args):  # the weight group's opening mark, a 16-byte tensor
            counts = [t._use_count() for t in tensors]
            return Work(self.pg.allreduce(tensors, *args), tensors, counts)

        def __getattr__(self, name):  # the group's other collectives, unchanged
            return getattr(self.pg, name)

    original = dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        count = tensor._use_count()
        out = original(tensor, *args, **kwargs)
        settle([tensor], [count])
        return out

    saved = [(h.pg, list(getattr(h, "pgs", []))) for h in holders]
    dist.broadcast = broadcast
    for h, (pg, pgs) in zip(holders, saved):  # `.pgs`: every group a weight group sends in (`.pg` among them)
        wrapped = {id(g): Group(g) for g in [pg, *pgs] if g is not None}
        h.pg = wrapped.get(id(pg))
        if pgs:
            h.pgs = [wrapped[id(g)] for g in pgs]
    try:
        yield
    finally:
        dist.broadcast = original
        for h, (pg, pgs) in zip(holders, saved):
            h.pg = pg
            if pgs:
                h.pgs = pgs
