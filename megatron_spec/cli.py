"""`megatron-spec` command line.

Each sub-command lives in its own module that exposes `register(subparsers)`; this file only lists them, so
adding a command never touches another command's code. Modules are imported when the parser is built, so they
must keep heavy imports (torch models, matplotlib, backends) inside their command functions.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute sub-commands, in the order `--help` lists them.
COMMAND_MODULES = (
    "megatron_spec.tasks.cli",  # pretrain
    "megatron_spec.rl.train_drafter",  # train-drafter
    "megatron_spec.bench.cli",  # bench engine | rollout | step
    "megatron_spec.sim.cli",  # simulate, tune
    "megatron_spec.rl.report",  # report
    "megatron_spec.rl.cli",  # train
    "megatron_spec.trainers.megatron.export_cli",  # export-hf
    "megatron_spec.stage",  # stage
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        # Bad input is reported as one clear line, not a traceback; bugs still raise.
        print(f"megatron-spec {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
