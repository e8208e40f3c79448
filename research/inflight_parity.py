"""Does the main job learn as well with async lag 2 and in-flight updates on Ray as synchronously in one process?

For each seed: the main job (`configs/tiny_grpo_spec.yaml`) for `--steps` steps twice, synchronous and inline, and
on Ray (disaggregated, one engine) with `backend.async_lag=2 backend.in_flight_updates=true`, both evaluated on
the 128 held-out problems before step 0 and after the last step (greedy). `--jobs` runs (2 by default) run at a
time, in seed order (nothing here is a timing). Writes research/records/inflight_parity_<tag>.json: per seed and run the held-out
accuracy before / after with its binomial standard error over the held-out problems, and for the in-flight run
the steps whose rollouts spanned two or more versions, the largest span and `policy_lag`, and the refit's wait
(`weight_sync_wait_s`) against the engine's generation.

`--set KEY=VALUE ...` changes the job for both runs alike (recorded). A rollout spans versions only when a refit
arrives while the engine still generates: with lag 2 the engine runs step s + 1's and s + 2's generations while the
trainer updates on step s, and the next refit is sent when that update ends, so the update must be the shorter of
the two. On the main job it is not: under a lag the whole-step gate is off, so the online drafter trains every step,
also on 20 left-out groups (`drafter_train.extra_groups`), and outlasts the generation; `drafter_train.extra_groups=0`
with 48 prompts a step turns that around. `--summarise` writes the record from runs already finished.

    python research/inflight_parity.py --seeds 0 1 --steps 30 --tag 30steps
    python research/inflight_parity.py --seeds 0 1 2 --steps 40 --set grpo.prompts_per_step=48 \
        drafter_train.extra_groups=0 --tag spanning_40steps
"""

from __future__ import annotations

import argparse
import json
import math
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
    """The training command of one run; `python -m` from the repository root, so this checkout's code runs."""
    return ["python", "-m", "megatron_spec.cli", "train", "--config", "configs/tiny_grpo_spec.yaml", f"run.seed={seed}",
            f"run.steps={steps}", f"run.eval_every={steps}", f"run.out_dir={out}", "run.report=false",
            "run.resume=false", *extra]


def standard_error(accuracy: float, n: int) -> float:
    """The binomial standard error of an accuracy measured on `n` problems."""
    return math.sqrt(accuracy * (1 - accuracy) / n)


def summary(run_dir: Path, n: int) -> dict:
    """One run's figures from its metrics.jsonl (`n`: held-out problems)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {"eval_accuracy_before": rows[0].get("eval_accuracy_before"), "eval_accuracy": rows[-1]["eval_accuracy"],
           "eval_accuracy_se": standard_error(rows[-1]["eval_accuracy"], n),
           "reward_mean_last10": sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])}
    if "policy_lag" in rows[0]:
        out.update(policy_lag_max=max(r["policy_lag"] for r in rows),
                   steps_spanning_versions=sum(r["rollout_version_span_max"] > 1 for r in rows), steps=len(rows),
                   rollout_versions_mean_max=max(r["rollout_versions_mean"] for r in rows),
                   rollout_version_span_max=max(r["rollout_version_span_max"] for r in rows),
                   weight_sync_wait_s_median=sorted(r["weight_sync_wait_s"] for r in rows)[len(rows) // 2],
                   engine_generate_s_median=sorted(r["engine_generate_s"] for r in rows)[len(rows) // 2])
    return out


def finished(run_dir: Path, steps: int) -> bool:
    """Whether the run in `run_dir` logged its last step (`steps` - 1) with its held-out accuracy."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return bool(rows) and rows[-1]["step"] == steps - 1 and rows[-1].get("eval_accuracy") is not None


def difference(seeds: dict, n: int) -> dict:
    """In-flight minus synchronous held-out accuracy after the run, per seed and pooled over seeds, each with its
    standard error (the two runs' binomial errors combined; pooled: of the mean of the per-seed differences)."""
    diffs = {s: r["lag2_inflight_ray"]["eval_accuracy"] - r["sync_inline"]["eval_accuracy"] for s, r in seeds.items()}
    ses = {s: math.hypot(r["lag2_inflight_ray"]["eval_accuracy_se"], r["sync_inline"]["eval_accuracy_se"])
           for s, r in seeds.items()}
    mean = sum(diffs.values()) / len(diffs)
    se = math.sqrt(sum(x * x for x in ses.values())) / len(ses)
    return {"per_seed": diffs, "per_seed_se": ses, "mean": mean, "mean_se": se, "mean_in_se": mean / se,
            "problems": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="30steps")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config changes for both runs")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (2: the two runs of a seed)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="the config's run.eval_prompts (the SE's n)")
    ap.add_argument("--work", default="/tmp/inflight_parity")
    ap.add_argument("--summarise", action="store_true", help="write the record from the runs already in --work "
                    "(those of --seeds that finished) without running any")
    args = ap.parse_args(argv)
    if bad := [kv for kv in args.set if "=" not in kv]:
        raise SystemExit(f"--set takes KEY=VALUE, got {bad}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    runs = {name: [*args.set, *extra] for name, extra in RUNS.items()}
    record = {"question": __doc__.splitlines()[0], "machine": machine(), "commit": commit,
              "command": "python research/inflight_parity.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "changes": args.set, "steps": args.steps,
              "runs": {name: " ".join(command(0, args.steps, Path("OUT"), extra)) for name, extra in runs.items()},
              "seeds": {}}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the Ray workers import this checkout's code too
    todo = [] if args.summarise else [(seed, name) for seed in args.seeds for name in runs]
    if args.summarise:  # a seed counts once both its runs wrote their last step's held-out accuracy
        for seed in args.seeds:
            outs = {name: Path(args.work) / f"seed{seed}_{name}" for name in runs}
            if all(finished(out, args.steps) for out in outs.values()):
                record["seeds"][str(seed)] = {name: summary(out, args.eval_prompts) for name, out in outs.items()}
        if not record["seeds"]:
            raise SystemExit(f"no seed of {args.seeds} has both runs finished in {args.work}")
    running: dict = {}
    while todo or running:
        while todo and len(running) < args.jobs:
            seed, name = todo.pop(0)
            out = Path(args.work) / f"seed{seed}_{name}"
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(f"{out}.log", "w") as log:
                cmd = command(seed, args.steps, out, runs[name])
                cmd[0] = sys.executable
                running[(seed, name)] = (out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                               stderr=subprocess.STDOUT))
        key = next(iter(running))
        out, proc = running.pop(key)
        if proc.wait() != 0:
            raise SystemExit(f"seed {key[0]} {key[1]} failed: see {out}.log")
        record["seeds"].setdefault(str(key[0]), {})[key[1]] = summary(out, args.eval_prompts)
        print(json.dumps({str(key[0]): {key[1]: record["seeds"][str(key[0])][key[1]]}}, indent=1), flush=True)
    record["accuracy_difference"] = difference(record["seeds"], args.eval_prompts)
    path = ROOT / "research" / "records" / f"inflight_parity_{args.tag}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
