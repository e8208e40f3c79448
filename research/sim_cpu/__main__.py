"""`python -m research.sim_cpu`: the CPU validation harness's commands (run from the repository root).

    python -m research.sim_cpu measured [FILE] [--cpu-profile JSON]   # validation (b): predicted vs measured
    python -m research.sim_cpu calibrate [--threads 2] [--cpu-profile JSON]   # (re)measure this CPU's profile
    python -m research.sim_cpu counts [--model tiny-qwen3] [--drafter mtp]   # operator counts of our code
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .measured import COMMITTED_MEASUREMENTS, COMMITTED_PROFILE, compare, format_comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.sim_cpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measured", help="predict a `megatron-spec bench step` file's stage times and compare")
    m.add_argument("file", nargs="?", default=str(COMMITTED_MEASUREMENTS[0]))
    m.add_argument("--cpu-profile", default=str(COMMITTED_PROFILE),
                   help="CPU profile JSON (default: the committed one; a missing path is measured and written)")
    c = sub.add_parser("calibrate", help="measure this CPU's profile (~3 s) and cache it")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--cpu-profile", default=None, help="where to write it (default ~/.cache/megatron_spec)")
    n = sub.add_parser("counts", help="the operator counts the model derives from our engine and trainer")
    n.add_argument("--model", default="tiny-qwen3", help="a dense preset")
    n.add_argument("--drafter", default="mtp", help="mtp, eagle3 or model (tiny-draft)")
    args = parser.parse_args(argv)
    if args.command == "counts":
        return _print_counts(args.model, args.drafter)
    if args.command == "measured":
        rows = compare(args.file, args.cpu_profile)
        print(format_comparison(rows))
        return 0 if all(r.ok for r in rows) else 1
    from .cpu_profile import load_or_measure

    print(json.dumps(asdict(load_or_measure(args.cpu_profile, threads=args.threads, remeasure=True)), indent=2))
    return 0


def _print_counts(name: str, drafter: str) -> int:
    from megatron_spec.models.presets import preset

    from . import counts

    m = preset(name)
    e = counts.engine(m, drafter)
    print(f"engine ({name}, {drafter}, batch {counts.BATCH}): forward {e.forward:.0f}, plain sampling "
          f"{e.plain_sample:.0f}, verify sampling {e.sample:.0f}, per draft forward {e.draft_forward:.0f}"
          f" + {e.draft_seq:.0f} per sequence, per verify step {e.draft_step:.0f}")
    print(f"logprob stage batch assembly: {counts.batch_ops(0):.0f} + {counts.batch_ops(1) - counts.batch_ops(0):.0f}"
          " per rollout")
    for fold, shared, online in ((False, False, None), (True, True, None), (True, True, drafter)):
        t = counts._trainer(counts._key(m), fold, shared, online)
        what = f"fold={fold}, shared={shared}, online drafter={online}"
        print(f"train_step ({what}): {t.train.fixed:.0f} + {t.train.per:.0f} per micro-batch"
              + (f" + {t.train_group:.0f} per prompt beyond 2" if shared else ""))
        if not fold:
            print(f"logprobs ({what}): {t.logprob.fixed:.0f} + {t.logprob.per:.0f} per micro-batch")
    print(f"elementwise floats per token per layer: {counts.activation_elements(m):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
