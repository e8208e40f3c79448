"""Model-parallel state for given TP / PP / EP sizes, the ranks and groups of this process, and a spawner that
runs a function on N local processes with gloo (CPU tests and the benchmark).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import require_megatron
from megatron_spec.distributed.process_groups import free_port
from megatron_spec.layout import check_layout

from .checks import Parallelism, check_parallelism

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402

__all__ = ["Parallelism", "Ranks", "init_model_parallel", "destroy_model_parallel", "ensure_process_group", "ranks",
           "spawn"]


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the model-parallel grid, with the groups the exporter gathers over."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    tp_group: Any
    pp_group: Any
    ep_group: Any
    etp_group: Any

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_model_parallel(par: Parallelism, cfg=None) -> Ranks:
    """Set up Megatron-Core's model-parallel groups (the default process group must exist).

    With `cfg` (a ModelConfig) the sizes are checked against the model first, so a bad split fails with a clear
    message instead of an assertion deep inside Megatron-Core.
    """
    if cfg is not None:
        check_parallelism(cfg, par)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first (or use spawn)")
    world = dist.get_world_size()
    if cfg is not None:
        check_parallelism(cfg, par, world)
    else:
        check_layout(None, par, world)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        virtual_pipeline_model_parallel_size=par.vp if par.vp > 1 else None,
    )
    return ranks()


def ensure_process_group() -> None:
    """Join the torchrun group (gloo on CPU, NCCL on GPUs), or make a one-process group when there is none."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=30))


def destroy_model_parallel() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def ranks() -> Ranks:
    """This process's coordinates, read from Megatron-Core's parallel state."""
    return Ranks(
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(), etp_group=ps.get_expert_tensor_parallel_group(),
    )


# ---------------------------------------------------------------------------------------------------------------
# Local multi-process runs
# ---------------------------------------------------------------------------------------------------------------


def _worker(rank: int, world_size: int, port: int, out_dir: str, threads: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(minutes=5))  # the parent's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, threads: int = 1) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` new processes joined by gloo; return each rank's result.

    `fn` must be importable (a module-level function). A failure on any rank raises here with its traceback.
    Results travel through `torch.save`, so tensors and plain containers are fine. The ranks meet at a store this
    process holds on a port the OS picked as it bound it, so a port cannot be taken between its choice and its use.
    """
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="megatron-spec-spawn-") as out:
        mp.spawn(_worker, args=(world_size, store.port, out, threads, fn, args), nprocs=world_size, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
