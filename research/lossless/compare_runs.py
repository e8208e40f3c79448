"""Compare two runs of the tiny recipe exactly: every metrics.jsonl column, and (when both have one) every rollout's
token ids from rollouts.jsonl (written by record_rollouts.py).

    python research/lossless/compare_runs.py RUN_A RUN_B [--json OUT.json]

Prints, per metrics column, the largest |A - B| over the common steps and whether every value is exactly equal;
per generate call, how many rollouts have identical token ids (and where the first differing one diverges) and the
largest |logprob difference| over rollouts whose tokens agree. Timing columns (stage times, tokens/s) differ between
any two runs and are listed separately; speculation-only columns (acceptance, drafter loss) are None in a plain run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TIMING = ("stages", "step_time", "tokens_per_s")
SPEC_ONLY = ("acceptance_length", "accepted_per_pos", "drafter_loss")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def absdiff(a, b) -> float:
    """|a - b| for numbers (bools as 0/1), 0 for equal non-numbers (None == None), inf otherwise."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return 0.0
        return abs(float(a) - float(b))
    return 0.0 if a == b else math.inf


def compare_metrics(a_dir: Path, b_dir: Path) -> dict:
    a = {m["step"]: m for m in read_jsonl(a_dir / "metrics.jsonl")}
    b = {m["step"]: m for m in read_jsonl(b_dir / "metrics.jsonl")}
    steps = sorted(set(a) & set(b))
    keys = [k for k in a[steps[0]] if k != "step" and k in b[steps[0]]]
    cols = {}
    for k in keys:
        diffs = [absdiff(a[s][k], b[s][k]) for s in steps]
        worst = max(diffs)  # inf: a value present in one run only (None in the other), e.g. spec-only columns
        cols[k] = {"max_abs_diff": None if math.isinf(worst) else worst, "identical": all(d == 0 for d in diffs),
                   "steps_differing": sum(d != 0 for d in diffs),
                   "group": "timing" if k in TIMING else "spec-only" if k in SPEC_ONLY else "training"}
    return {"steps": len(steps), "columns": cols}


def compare_rollouts(a_dir: Path, b_dir: Path) -> dict | None:
    fa, fb = a_dir / "rollouts.jsonl", b_dir / "rollouts.jsonl"
    if not (fa.is_file() and fb.is_file()):
        return None
    calls = []
    for ca, cb in zip(read_jsonl(fa), read_jsonl(fb)):
        same, first_div, lp = 0, [], 0.0
        for ta, tb, la, lb in zip(ca["token_ids"], cb["token_ids"], ca["logprobs"], cb["logprobs"]):
            if ta == tb:
                same += 1
                lp = max([lp] + [abs(x - y) for x, y in zip(la, lb)])
            else:
                first_div.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))))
        calls.append({"call": ca["call"], "kind": ca["kind"], "step": ca["step"], "rollouts": len(ca["token_ids"]),
                      "identical_rollouts": same, "first_divergence_min": min(first_div) if first_div else None,
                      "max_abs_logprob_diff_identical": lp})
    return {"calls": calls, "all_identical": all(c["identical_rollouts"] == c["rollouts"] for c in calls),
            "tokens_compared": sum(c["rollouts"] for c in calls)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--json", type=Path, help="also write the comparison here")
    args = p.parse_args(argv)
    out = {"a": str(args.run_a), "b": str(args.run_b), "metrics": compare_metrics(args.run_a, args.run_b),
           "rollouts": compare_rollouts(args.run_a, args.run_b)}
    print(f"{args.run_a} vs {args.run_b}: {out['metrics']['steps']} common steps")
    for k, c in out["metrics"]["columns"].items():
        worst = "n/a" if c["max_abs_diff"] is None else format(c["max_abs_diff"], ".3g")
        print(f"  {k:<20} {c['group']:<9} identical={c['identical']!s:<5} max|diff|={worst} "
              f"steps differing={c['steps_differing']}")
    r = out["rollouts"]
    if r is None:
        print("  (no rollouts.jsonl in both runs: token ids not compared)")
    else:
        for c in r["calls"]:
            print(f"  call {c['call']:>2} {c['kind']:<5} step {c['step']:>2}: "
                  f"{c['identical_rollouts']}/{c['rollouts']} "
                  f"rollouts identical, first divergence at token {c['first_divergence_min']}, "
                  f"max |logprob diff| on identical ones {c['max_abs_logprob_diff_identical']:.3g}")
        print(f"  all rollouts identical: {r['all_identical']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
