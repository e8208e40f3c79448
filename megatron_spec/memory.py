"""Peak memory of the processes a run is made of, for the per-step metrics.

Host: a process's peak resident set (`VmHWM` in `/proc/<pid>/status`; `getrusage` where /proc is absent), which
Linux lets the process reset (`echo 5 > /proc/<pid>/clear_refs`), so each step can report its own peak rather
than the largest since start-up. Device: torch's peak allocated and reserved CUDA memory, reset the same way.

The loop logs, per step, `memory`: its own peak (the process that also hosts an in-process generator and, for
the Megatron trainer, rank 0), the peaks of its child processes (a vLLM generator's engine processes), and what
the trainer reports for each of its ranks (`trainer_peak_rss_mb`, and on CUDA `trainer_cuda_peak_*_mb`).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

MB = 2**20


def _status_bytes(pid: int | str, field: str) -> int | None:
    """A `/proc/<pid>/status` size field (reported in kB) in bytes; None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """Peak resident set of process `pid` since it started or since its last `reset_peak`; None if unreadable."""
    peak = _status_bytes(pid, "VmHWM")
    if peak is None and pid == "self":  # no /proc: the process's peak since start (kilobytes on Linux)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def rss_bytes(pid: int | str = "self") -> int | None:
    """Current resident set of process `pid`."""
    return _status_bytes(pid, "VmRSS")


def reset_peak(pid: int | str = "self") -> bool:
    """Start a new peak at the current resident set; False where the kernel does not allow it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def children(pid: int | str = "self") -> list[int]:
    """Every descendant process of `pid` (from /proc's children lists; empty where /proc lacks them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def cuda_peaks(reset: bool = True) -> dict:
    """This process's peak allocated and reserved CUDA memory in MB (empty without CUDA); `reset` starts anew."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out = {"cuda_peak_allocated_mb": torch.cuda.max_memory_allocated() / MB,
           "cuda_peak_reserved_mb": torch.cuda.max_memory_reserved() / MB}
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return out


def step_memory(reset: bool = True) -> dict:
    """The loop process's peak RSS (and CUDA peaks) since the last call, and each child process's peak RSS
    (`children_peak_rss_mb`: a vLLM generator's engine processes; only when there are any); `reset` starts the
    next step's peaks."""
    peak = peak_rss_bytes()
    out = {"loop_peak_rss_mb": None if peak is None else peak / MB, **cuda_peaks(reset)}
    kids = [(pid, peak_rss_bytes(pid)) for pid in children()]
    kids = [(pid, p) for pid, p in kids if p is not None]
    if kids:
        out["children_peak_rss_mb"] = [p / MB for _, p in kids]
    if reset:
        reset_peak()
        for pid, _ in kids:
            reset_peak(pid)
    return out
