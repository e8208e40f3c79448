"""Every trainer rank's memory peaks, gathered for the metrics the loop logs on rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_spec import memory

from .step import device


def rank_memory() -> dict:
    """Every rank's peak RSS (and CUDA peaks) in MB, as lists by global rank. Collective. Ranks > 0 then start
    new peaks; rank 0's belongs to the loop's process, whose step ends later (`memory.step_memory`)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = memory.cuda_peaks(reset=rank != 0)
    keys = ["trainer_peak_rss_mb", *(f"trainer_{k}" for k in sorted(cuda))]
    table = torch.zeros(len(keys), world, dtype=torch.float64, device=device())
    table[0, rank] = (memory.peak_rss_bytes() or 0) / memory.MB
    for i, k in enumerate(sorted(cuda), 1):
        table[i, rank] = cuda[k]
    if world > 1:
        dist.all_reduce(table)
    if rank != 0:
        memory.reset_peak()
    return {k: row.tolist() for k, row in zip(keys, table.cpu())}
