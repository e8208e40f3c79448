"""What writes a background checkpoint's shards: a process of its own (`run.async_save_writer="process"`, the
default, `WriterProcess`) or a thread of the trainer's process (`"thread"`, `in_this_thread`).

A thread of the trainer's process competes with the step for the GIL while it serializes; a process does not.
The process is spawned, not forked (a forked child would turn every page the step then writes into a copy-on-write
fault), once per trainer process, niced like the thread, and exits when its parent is gone. The shards reach it
without a copy: the snapshot at the step boundary copies them into one shared-memory buffer (`SharedSnapshot`,
kept and reused from save to save), and the process is handed the buffer and each tensor's place in it. It runs
Megatron-Core's per-file writer as the thread does and hands back the write results, which the caller puts where
Megatron's finalization reads them; the finalization and the atomic rename are unchanged.
"""

from __future__ import annotations

import os
import queue

import torch

_ALIGN = 64


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a contiguous view into a larger storage the same memory as a tensor whose storage is exactly its
    own bytes (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    raw = torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy())  # shares t's memory, keeps t alive
    return raw.view(t.dtype).view(t.shape)


def in_this_thread(transforms, use_msc: bool, rank: int, buckets: list, results) -> None:
    """What Megatron-Core's `write_preloaded_data_multiproc` does, file after file in the calling thread: its
    per-file writer, the results handed to `results` as it hands them. Its own runner forks a process per file,
    which on a host training at the same time makes every page the step then writes (weights, gradients, moments)
    a copy-on-write fault for as long as the children live: the step ran 3-4 times slower during the write."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local, count, out = queue.SimpleQueue(), queue.Queue(), {}
    for i, bucket in enumerate(buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, use_fsync=True,
                                                   **({"use_msc": True} if use_msc else {}))
        idx, written = local.get()
        if isinstance(written, Exception):
            out = written
            break
        out[idx] = written
    results.put(out)


class SharedSnapshot:
    """One shared-memory byte buffer holding a snapshot's host tensors end to end, grown when a save needs more."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _sizes(tensors: list[torch.Tensor]) -> list[int]:
        return [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]

    def fits(self, tensors: list[torch.Tensor]) -> tuple[bool, int, int]:
        """Whether the buffer holds `tensors` or /dev/shm has room to grow it: (fits, bytes needed, bytes free)."""
        need = sum(self._sizes(tensors))
        if need <= self.buffer.numel():
            return True, need, self.buffer.numel()
        try:
            st = os.statvfs("/dev/shm")
        except OSError:  # no /dev/shm to measure (torch shares memory another way there)
            return True, need, -1
        free = st.f_bavail * st.f_frsize + self.buffer.numel()  # the old buffer is freed before the new one
        return need <= free, need, free

    def take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in the buffer, each a tensor whose storage is exactly its own bytes (the writer
        clones a view into a larger storage), in `tensors`' order."""
        sizes = self._sizes(tensors)
        if self.buffer.numel() < sum(sizes):
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed first
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8).share_memory_()
        out, offset = [], 0
        for t, size in zip(tensors, sizes):
            n = t.numel() * t.element_size()
            region = self.buffer[offset:offset + n].view(t.dtype).view(t.shape)
            region.copy_(t.detach())
            out.append(whole_storage(region))
            offset += size
        return out


def _places(buffer: torch.Tensor, buckets: list) -> list:
    """`buckets` with each tensor inside `buffer` replaced by (offset, dtype, shape); others are left as tensors
    (the queue then moves them to shared memory itself)."""
    base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    out = []
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        items = []
        for item, t in tensor_data:
            nbytes = t.numel() * t.element_size()
            inside = t.device.type == "cpu" and base <= t.data_ptr() and t.data_ptr() + nbytes <= end
            items.append((item, ("shared", t.data_ptr() - base, str(t.dtype), list(t.shape)) if inside else t))
        out.append((file_name, storage_key, (bytes_data, items)))
    return out


def _tensors(buffer: torch.Tensor, buckets: list) -> list:
    def tensor(x):
        if isinstance(x, tuple) and x and x[0] == "shared":
            _, offset, dtype, shape = x
            dt = getattr(torch, dtype.removeprefix("torch."))
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            return whole_storage(buffer[offset:offset + n].view(dt).view(shape))
        return x

    return [(f, k, (b, [(item, tensor(x)) for item, x in items])) for f, k, (b, items) in buckets]


def _serve(jobs, replies, parent: int) -> None:
    """The writer process: each job's buckets written with Megatron's per-file writer; the results (or the
    error, as text) replied. Exits when the parent process is gone."""
    from megatron_spec.rl.checkpoint import WRITER_NICE

    try:
        os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)
    except (AttributeError, OSError):
        pass
    torch.set_num_threads(1)
    while os.getppid() == parent:
        try:
            transforms, use_msc, rank, buffer, buckets = jobs.get(timeout=1.0)
        except queue.Empty:
            continue
        results = queue.SimpleQueue()
        try:
            in_this_thread(transforms, use_msc, rank, _tensors(buffer, buckets), results)
            out = results.get()
            if isinstance(out, Exception):
                out = RuntimeError(f"checkpoint writer process: {out!r}")
        except BaseException as err:  # noqa: BLE001  (replied; the caller raises it)
            out = RuntimeError(f"checkpoint writer process: {err!r}")
        del buffer, buckets
        replies.put(out)


class WriterProcess:
    """The spawned writer and the shared buffer its snapshots go through. Called as `in_this_thread` is, from the
    caller's writer thread, which only waits while the process writes."""

    def __init__(self):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.snapshot = SharedSnapshot()
        self.jobs, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_serve, args=(self.jobs, self.replies, os.getpid()), daemon=True,
                                   name="checkpoint-writer")
        self.process.start()

    def __call__(self, transforms, use_msc: bool, rank: int, buckets: list, results) -> None:
        self.jobs.put((transforms, use_msc, rank, self.snapshot.buffer, _places(self.snapshot.buffer, buckets)))
        while True:
            try:
                out = self.replies.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    out = RuntimeError(f"checkpoint writer process ended (exit code {self.process.exitcode})")
                    break
        results.put(out)


_writer: WriterProcess | None = None


def writer_process() -> WriterProcess:
    """This process's writer process, started on first use."""
    global _writer
    if _writer is None or not _writer.process.is_alive():
        _writer = WriterProcess()
    return _writer
