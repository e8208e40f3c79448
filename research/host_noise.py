"""How far two processes doing identical work drift apart on this host, the yardstick for the main job's wall-clock
whole-step ratios (`benchmarks/main_job.py --together --swap-cores`).

Two pairs, each run as the benchmark runs its pairs (together, one torch thread each, each pinned to one core, then
again with the cores swapped):
- `twins`: two `spec=null` runs of the same seed: the same computation in two processes;
- `gated_plain`: the shipped main job with its whole-step gate held on plain decoding for every step, beside a
  `spec=null` run: the same computation again, in a process that also holds the drafter, its optimizer and its
  average, so any cost of that process's set-up beyond the computation shows here.
Both pairs must write the same rollouts (checked); the ratio is the second run's step time over the first's, per
round and over both rounds.

    python research/host_noise.py --out research/records/host_noise.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["run.threads=1", "run.steps=50", "run.eval_every=0", "run.report=false", "run.resume=false"]
# The main job with its gate held plain: every step runs as `spec=null` runs it, in the spec run's process.
HELD_PLAIN = ("import runpy, sys; from megatron_spec.speculative import adaptive; "
              "adaptive.WholeStepGate.speculate = lambda self: False; sys.argv = ['tiny_grpo_spec'] + sys.argv[1:]; "
              "runpy.run_path('recipes/tiny_grpo_spec.py', run_name='__main__')")
PAIRS = {"twins": (["spec=null"], ["spec=null"], False), "gated_plain": ([], ["spec=null"], True)}


def launch(overrides: list[str], out: Path, core: int, held_plain: bool, seed: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", HELD_PLAIN] if held_plain else [sys.executable, "recipes/tiny_grpo_spec.py"]
    args = [*BASE, f"run.seed={seed}", f"run.out_dir={out}", *overrides]
    return subprocess.Popen(["taskset", "-c", str(core), *cmd, *args], cwd=ROOT, stdout=subprocess.DEVNULL)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measure(name: str, runs_dir: Path, seed: int) -> dict:
    first, second, held = PAIRS[name]
    rounds = []
    for cores in ((0, 1), (1, 0)):
        dirs = [runs_dir / f"{name}-{i}-c{c}" for i, c in enumerate(cores)]
        procs = [launch(first, dirs[0], cores[0], held, seed), launch(second, dirs[1], cores[1], False, seed)]
        if any(p.wait() for p in procs):
            raise SystemExit(f"{name}: a run failed (see {dirs})")
        a, b = rows(dirs[0]), rows(dirs[1])
        if [r["gen_tokens"] for r in a] != [r["gen_tokens"] for r in b]:
            raise SystemExit(f"{name}: the two runs wrote different rollouts")
        step_a, step_b = (sum(r["step_time"] for r in x) for x in (a, b))
        gen_a, gen_b = (sum(r["stages"]["gen"] for r in x) for x in (a, b))
        rounds.append({"cores": list(cores), "step_s": [step_a, step_b], "second_over_first": step_b / step_a,
                       "gen_second_over_first": gen_b / gen_a})
    total = [sum(r["step_s"][i] for r in rounds) for i in (0, 1)]
    return {"rounds": rounds, "second_over_first": total[1] / total[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-dir", default="runs/host_noise")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron_spec.bench.common import machine

    result = {"machine": machine(), "command": "python research/host_noise.py", "seed": args.seed,
              "pairs": {name: measure(name, Path(args.runs_dir).resolve(), args.seed) for name in PAIRS}}
    for name, r in result["pairs"].items():
        per_round = " / ".join(f"{x['second_over_first']:.3f}" for x in r["rounds"])
        print(f"{name}: step time, second run over first, per round {per_round}; both rounds {r['second_over_first']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
