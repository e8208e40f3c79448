"""`python -m benchmarks.sim_cpu`: the CPU validation harness's commands (run from the repository root).

    python -m benchmarks.sim_cpu measured [FILE] [--cpu-profile JSON]   # validation (b): predicted vs measured
    python -m benchmarks.sim_cpu calibrate [--threads 2] [--cpu-profile JSON]   # (re)measure this CPU's profile
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .measured import COMMITTED_MEASUREMENTS, COMMITTED_PROFILE, compare, format_comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_cpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measured", help="predict a `megatron-spec bench step` file's stage times and compare")
    m.add_argument("file", nargs="?", default=str(COMMITTED_MEASUREMENTS[0]))
    m.add_argument("--cpu-profile", default=str(COMMITTED_PROFILE),
                   help="CPU profile JSON (default: the committed one; a missing path is measured and written)")
    c = sub.add_parser("calibrate", help="measure this CPU's profile (~3 s) and cache it")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--cpu-profile", default=None, help="where to write it (default ~/.cache/megatron_spec)")
    args = parser.parse_args(argv)
    if args.command == "measured":
        rows = compare(args.file, args.cpu_profile)
        print(format_comparison(rows))
        return 0 if all(r.ok for r in rows) else 1
    from .cpu_profile import load_or_measure

    print(json.dumps(asdict(load_or_measure(args.cpu_profile, threads=args.threads, remeasure=True)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
