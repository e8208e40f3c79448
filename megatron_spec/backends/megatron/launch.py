"""Starting the ranks of a Megatron-trained RL run: `torchrun --nproc-per-node N recipes/<recipe>.py
backend.trainer=megatron backend.megatron.ep=2 ...` (a recipe's `main` calls `recipe_main` here).

Rank 0 runs the recipe as usual (the RL loop generates, logs and checkpoints there, alone); when the loop builds
its `MegatronPolicy` it announces the config, and every other rank builds its own from the same checkpoints and
then follows rank 0's calls (`MegatronPolicy.follow`). When rank 0 is done, with or without an error, it tells the
others to stop. Without torchrun (no `WORLD_SIZE`), or with one process, the recipe runs in this process as
usual; a `MegatronPolicy` in a single process starts a one-rank gloo group itself
(`parallel.ensure_process_group`).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from . import require_megatron
from .parallel import destroy_model_parallel, ensure_process_group

require_megatron()


def follow_run() -> None:
    """Ranks > 0: wait for rank 0's policy config, build the same policy, follow it until told to stop."""
    from megatron_spec.models import from_pretrained
    from megatron_spec.rl.loop import load_drafter_for

    from .policy import BUILD, STOP, MegatronPolicy

    box = [None]
    dist.broadcast_object_list(box, src=0)
    name, args = box[0]
    if name == STOP:
        return
    if name != BUILD:
        raise RuntimeError(f"rank {dist.get_rank()} expected the policy config from rank 0, got {name!r}")
    (cfg,) = args
    torch.set_num_threads(max(1, cfg.run.threads // dist.get_world_size()))
    torch.manual_seed(cfg.run.seed)
    model = from_pretrained(cfg.model.policy)
    MegatronPolicy.from_rl(cfg, model, load_drafter_for(cfg, model)).follow()


def recipe_main(build: Callable, argv: list[str] | None = None) -> int:
    """A recipe's entry under torchrun: rank 0 runs `recipes._common.recipe_main`, the others follow it."""
    from recipes._common import recipe_main as run_recipe

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return run_recipe(build, argv)
    ensure_process_group()
    try:
        if dist.get_rank() == 0:
            from .policy import STOP

            try:
                return run_recipe(build, argv)
            finally:
                dist.broadcast_object_list([(STOP, ())], src=0)
        follow_run()
        return 0
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
