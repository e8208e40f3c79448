"""`megatron-spec pretrain`: train a tiny reference model on the arithmetic task (see `pretrain.py`)."""

from __future__ import annotations

import argparse
import os

from .arithmetic import Difficulty
from .pretrain_config import TINY_PRESETS, PretrainConfig

# Optional flags -> PretrainConfig fields; a flag left out keeps the dataclass default (the one place defaults live).
_OPTIONAL = {
    "steps": (int, "optimizer steps"),
    "seed": (int, "seed of weights, data and held-out set"),
    "batch_size": (int, "sequences per step"),
    "lr": (float, "peak AdamW learning rate"),
    "log_every": (int, "steps between progress lines"),
    "slip_rate": (float, "share of carrying lines whose carry the corpus drops"),
    "careful_rate": (float, "share of the corpus written by the careful writer (units column first, no slips)"),
    "init": (str, "checkpoint of the same preset to continue from"),
}
# Flags of the task itself -> Difficulty fields (the held-out set and the RL task read them from task.json).
_DIFFICULTY = {
    "min_terms": (int, "fewest operands in a chain"),
    "max_terms": (int, "most operands in a chain"),
    "max_operand": (int, "operands are drawn from [0, max_operand]"),
    "ops": (str, "operators to draw from, e.g. '+-'"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pretrain",
        help="pretrain a tiny model on worked arithmetic solutions (CPU, minutes)",
        description="Train a tiny preset (from scratch, or on from --init) on worked arithmetic solutions, print "
        "its held-out greedy accuracy and save it in HF layout (config.json, model.safetensors, task.json).",
    )
    p.add_argument("--preset", required=True, help=", ".join(TINY_PRESETS))
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    defaults = PretrainConfig.__dataclass_fields__
    for name, (kind, doc) in _OPTIONAL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{doc} (default {defaults[name].default})")
    for name, (kind, doc) in _DIFFICULTY.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind,
                       help=f"{doc} (default {Difficulty.__dataclass_fields__[name].default})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in _OPTIONAL if getattr(args, name) is not None}
    task = {name: getattr(args, name) for name in _DIFFICULTY if getattr(args, name) is not None}
    # Bad arguments fail here, before torch loads.
    cfg = PretrainConfig(preset=args.preset, out=args.out, difficulty=Difficulty(**task), **given)

    import torch

    from .pretrain import pretrain

    # A user's OMP_NUM_THREADS wins; otherwise one thread per core this process may run on (torch's own default
    # can count the host's cores inside a container and oversubscribe the ones the cgroup grants).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    pretrain(cfg)
    return 0
