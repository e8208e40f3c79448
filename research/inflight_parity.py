"""Does the main job learn as well with async lag 2 and in-flight updates on Ray as synchronously in one process?

For each seed: the main job (`configs/tiny_grpo_spec.yaml`) for `--steps` steps twice, synchronous and inline, and
on Ray (disaggregated, one engine) with `backend.async_lag=2 backend.in_flight_updates=true`, both evaluated on
the 128 held-out problems before step 0 and after the last step (greedy). The two runs of a seed run at the same
time (nothing here is a timing). Writes research/records/inflight_parity_<tag>.json: per seed and run the held-out
accuracy before / after, and for the in-flight run the steps whose rollouts spanned two or more versions, the
largest `policy_lag`, and the refit's wait (`weight_sync_wait_s`) against the engine's generation.

    python research/inflight_parity.py --seeds 0 1 --steps 30 --tag 30steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "sync_inline": [],
    "lag2_inflight_ray": ["backend.placement=disaggregated", "backend.async_lag=2", "backend.in_flight_updates=true"],
}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    isa = "AVX-512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "AVX2"
    return f"{os.cpu_count()} cores, {isa}, {model} (shared with other jobs)"


def command(seed: int, steps: int, out: Path, extra: list[str]) -> list[str]:
    return ["megatron-spec", "train", "--config", "configs/tiny_grpo_spec.yaml", f"run.seed={seed}",
            f"run.steps={steps}", f"run.eval_every={steps}", f"run.out_dir={out}", "run.report=false", *extra]


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {"eval_accuracy_before": rows[0].get("eval_accuracy_before"), "eval_accuracy": rows[-1]["eval_accuracy"],
           "reward_mean_last10": sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])}
    if "policy_lag" in rows[0]:
        out.update(policy_lag_max=max(r["policy_lag"] for r in rows),
                   steps_spanning_versions=sum(r["rollout_version_span_max"] > 1 for r in rows),
                   rollout_version_span_max=max(r["rollout_version_span_max"] for r in rows),
                   weight_sync_wait_s_median=sorted(r["weight_sync_wait_s"] for r in rows)[len(rows) // 2],
                   engine_generate_s_median=sorted(r["engine_generate_s"] for r in rows)[len(rows) // 2])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="30steps")
    ap.add_argument("--work", default="/tmp/inflight_parity")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"question": __doc__.splitlines()[0], "machine": machine(), "commit": commit,
              "command": "python research/inflight_parity.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "runs": {name: " ".join(command(0, args.steps, Path("OUT"), extra)) for name, extra in RUNS.items()},
              "seeds": {}}
    for seed in args.seeds:
        procs = {}
        for name, extra in RUNS.items():
            out = Path(args.work) / f"seed{seed}_{name}"
            out.parent.mkdir(parents=True, exist_ok=True)
            log = open(f"{out}.log", "w")
            procs[name] = (out, subprocess.Popen(command(seed, args.steps, out, extra), cwd=ROOT, stdout=log,
                                                 stderr=subprocess.STDOUT))
        for name, (out, proc) in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"seed {seed} {name} failed: see {out}.log")
        record["seeds"][seed] = {name: summary(out) for name, (out, _) in procs.items()}
        print(json.dumps({seed: record["seeds"][seed]}, indent=1), flush=True)
    path = ROOT / "research" / "records" / f"inflight_parity_{args.tag}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
