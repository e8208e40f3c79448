"""`megatron-spec train`: the GRPO loop on the embedded engine, from a YAML config plus `key=value` overrides."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="GRPO with speculative rollouts on the embedded engine (YAML config + key=value overrides)",
        description="Run (or resume) a GRPO job on the embedded engine. The config is the RLConfig defaults (the "
        "tiny job), then --config laid over them, then the overrides in order.",
        epilog="example: megatron-spec train --config configs/tiny_grpo_spec.yaml run.steps=5 spec.method=ngram",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. grpo.group_size=4 spec=null spec.num_speculative_tokens=5")
    p.add_argument("--config", help="YAML config (configs/*.yaml); keys it leaves out keep their defaults")
    p.add_argument("--dryrun", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Config errors (unknown key, bad value, group_size=1) surface here as ValueErrors, before torch is loaded.
    from .config import RLConfig
    from .overrides import apply_overrides, dump_yaml, load_yaml

    cfg = load_yaml(args.config) if args.config else RLConfig()
    cfg = apply_overrides(cfg, args.overrides)
    if args.dryrun:
        print(dump_yaml(cfg), end="")
        return 0
    from . import loop

    summary = loop.train(cfg)
    print(json.dumps(summary, default=str, sort_keys=True))
    return 0
