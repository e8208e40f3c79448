"""Starting the ranks of a Megatron-trained RL run: `torchrun --nproc-per-node N recipes/<recipe>.py
backend.trainer=megatron backend.megatron.ep=2 ...` (a recipe's `main` hands its own run to `recipe_main` here).

Rank 0 runs the recipe as usual (the RL loop generates, logs and checkpoints there, alone); when the loop builds
its `MegatronPolicy` it announces the config, and every other rank builds its own from the same checkpoints and
then follows rank 0's calls (`MegatronPolicy.follow`). When rank 0 is done, with or without an error, it tells the
others to stop. Without torchrun (no `WORLD_SIZE`), or with one process, the recipe runs in this process as
usual; a `MegatronPolicy` in a single process starts a one-rank gloo group itself
(`parallel.ensure_process_group`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

import torch
import torch.distributed as dist

from . import require_megatron
from .parallel import destroy_model_parallel
from .protocol import BUILD, STOP, announce, receive

require_megatron()


def follow_run() -> None:
    """Ranks > 0: wait for rank 0's policy config, build the same policy (each rank reading only its own slices of
    the checkpoint files), follow it until told to stop."""
    from .policy import MegatronPolicy

    name, args = receive()
    if name == STOP:
        return
    if name != BUILD:
        raise RuntimeError(f"rank {dist.get_rank()} expected the policy config from rank 0, got {name!r}")
    (cfg,) = args
    # Rank 0 runs the loop and decides when to save and stop (`rl.stop`): its save is announced to every rank. A
    # SIGUSR1 that reaches this rank too (SLURM signalling a whole step) must not end it before that save.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    torch.set_num_threads(max(1, cfg.run.threads // dist.get_world_size()))
    torch.manual_seed(cfg.run.seed)
    MegatronPolicy.from_rl(cfg).follow()


def init_timeout_s(argv: list[str] | None) -> float:
    """`backend.init_timeout_s` as the command line overrides it (the group starts before the config is built),
    else the config's default."""
    from megatron_spec.rl.backend_config import BackendSection

    for arg in argv if argv is not None else sys.argv[1:]:
        if arg.startswith("backend.init_timeout_s="):
            return float(arg.split("=", 1)[1])
    return BackendSection.init_timeout_s


def join_torchrun_group(timeout_s: float) -> None:
    """Join torchrun's group: NCCL on the GPU `LOCAL_RANK` (torchrun's per-node index) names, gloo on CPUs, with
    `timeout_s` for the rendezvous and every later collective (followers wait in one while rank 0 loads); then a
    device-correct all-reduce proves every rank is in. A rank that cannot join fails with its rank in the message."""
    from datetime import timedelta

    from ...distributed.process_groups import collective_backend, collective_device

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = collective_backend()
    device = collective_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones)
    except (RuntimeError, dist.DistError) as err:
        raise RuntimeError(f"rank {rank} of {world} could not join the trainer group ({backend}, "
                           f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}) within "
                           f"{timeout_s:g} s (backend.init_timeout_s): {err}") from err


def recipe_main(run_recipe: Callable[[], int], argv: list[str] | None = None) -> int:
    """A recipe's entry under torchrun: rank 0 calls `run_recipe()` (the recipe's own run, the RL loop inside it),
    the others follow it; `argv` is the recipe's command line, read here for `backend.init_timeout_s`."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return run_recipe()
    join_torchrun_group(init_timeout_s(argv))
    try:
        if dist.get_rank() == 0:
            try:
                return run_recipe()
            finally:
                announce(STOP)
        follow_run()
        return 0
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
