"""`megatron-spec train`: the GRPO loop from a YAML config plus `key=value` overrides; with no `--config`, the main
job (`configs/tiny_grpo_spec.yaml`, generated from `recipes/tiny_grpo_spec.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAIN_JOB = Path("configs/tiny_grpo_spec.yaml")
"""The main job's config, read relative to the repository root like the checkpoints it names."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="GRPO with speculative rollouts on the embedded engine (YAML config + key=value overrides)",
        description="Run (or resume) a GRPO job. The config is the RLConfig defaults, then --config laid over them "
        f"(default {MAIN_JOB}: the main job, run from the repository root), then the overrides in order.",
        epilog="example: megatron-spec train run.steps=5 spec.method=ngram",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. grpo.group_size=4 spec=null spec.num_speculative_tokens=5")
    p.add_argument("--config", help=f"YAML config (configs/*.yaml; default {MAIN_JOB}); keys it leaves out keep their "
                   "defaults")
    p.add_argument("--dryrun", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Config errors (unknown key, bad value, group_size=1) surface here as ValueErrors, before torch is loaded.
    from .overrides import apply_overrides, dump_yaml, load_yaml

    if args.config is None and not MAIN_JOB.is_file():
        raise FileNotFoundError(f"megatron-spec train without --config runs the main job, {MAIN_JOB}, which is not "
                                f"under {Path.cwd()}: run it from the repository root or pass --config FILE")
    cfg = load_yaml(args.config or MAIN_JOB)
    cfg = apply_overrides(cfg, args.overrides)
    if args.dryrun:
        print(dump_yaml(cfg), end="")
        return 0
    from . import loop

    summary = loop.train(cfg)
    print(json.dumps(summary, default=str, sort_keys=True))
    return 0
