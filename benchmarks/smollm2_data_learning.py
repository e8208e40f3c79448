"""Does SmolLM2-135M learn from a dataset file through the at-scale backends: GRPO with the Megatron trainer, vLLM
rollouts drafted by an EAGLE-3 head trained online, math-verify rewards, held-out accuracy before and after?

The dataset is the natural-language arithmetic task (`tasks/natural.py`) written out as jsonl files (`train.jsonl`,
`test.jsonl`: `question`, `answer` columns) and read back through `data.path` (format `custom`), so the run goes
through the dataset loader, SmolLM2's chat template and the math-verify reward exactly as a user's file would. The
held-out accuracy is greedy, on the first `run.eval_prompts` rows of the test split, before the first update and
every `run.eval_every` steps.

    python benchmarks/smollm2_data_learning.py --out research/records/smollm2_data_learning.json

Writes the record (config, per-step metrics, accuracies, acceptance lengths, drafter losses, wall time, machine,
commit) and a figure beside it (`.png`: held-out accuracy and acceptance length per step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "model.policy=smollm2-135m", "model.drafter=checkpoints/smollm2-135m-eagle3", "model.task=natural",
    "backend.trainer=megatron", "backend.generator=vllm", "spec.method=eagle3", "spec.num_speculative_tokens=3",
    "spec.adaptive=false", "spec.model=checkpoints/smollm2-135m-eagle3", "drafter_train.online=true",
    "drafter_train.drafts=1", "drafter_train.replay=1", "drafter_train.minibatches=1", "drafter_train.gate=false",
    "data.format=custom", "data.prompt_key=question", "data.answer_key=answer", "data.eval_split=test",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_tokens=64", "grpo.lr=1e-5",
    "grpo.drop_uniform_groups=false", "run.eval_prompts=50", "run.eval_every=10", "run.save_every=1000",
    "run.resume=false", "run.report=false", "run.loggers=[]", "run.threads=2",
]
"""The run's overrides of the SmolLM2 recipe (`recipes/smollm2_grpo_spec.py`); `--steps`, `--data`, `--run-dir`
and the arguments after `--` are added."""


def write_data(out: Path, train: int, test: int, seed: int) -> Path:
    """`train.jsonl` and `test.jsonl` of natural-language arithmetic problems (question with its instruction,
    integer answer): the test rows are another random stream, not a slice of the training rows."""
    from megatron_spec.tasks.natural import NaturalDataset

    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        rows = [{"question": p.question, "answer": p.answer} for p in NaturalDataset(n, seed, split=split)]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    import torch

    return f"CPU {cpu} {isa}, {os.cpu_count()} cpus (torch {torch.__version__}); shared with other jobs"


def figure(rows: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    evals = [(-1, rows[0]["eval_accuracy_before"])] if rows and rows[0].get("eval_accuracy_before") is not None else []
    evals += [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    a.plot([s for s, _ in evals], [v for _, v in evals], "o-")
    a.plot([r["step"] for r in rows], [r["accuracy"] for r in rows], ".", alpha=0.5, label="train batch")
    a.set(xlabel="step (-1: before the first update)", ylabel="accuracy", title="held-out greedy accuracy")
    a.legend(["held-out (50 prompts)", "train rollouts"])
    b.plot([r["step"] for r in rows], [r["acceptance_length"] for r in rows], ".-")
    b.set(xlabel="step", ylabel="tokens per verify step", title="vLLM acceptance length (EAGLE-3 online, k = 3)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--data", default="runs/smollm2-data/data", help="where the jsonl files are written")
    p.add_argument("--run-dir", default="runs/smollm2-data/run")
    p.add_argument("--train-rows", type=int, default=2048)
    p.add_argument("--test-rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", default=None, help="data.reward (default: math-verify, which scores a restated "
                   "expression such as '7 + 9' as 0; megatron_spec.tasks.reward:reward reads the final "
                   "'The answer is N')")
    p.add_argument("--out", required=True, help="record JSON (the figure goes beside it as .png)")
    p.add_argument("extra", nargs="*", help="further overrides (after --)")
    args = p.parse_args(argv)
    from megatron_spec.rl.logging import read_metrics

    data = write_data(ROOT / args.data, args.train_rows, args.test_rows, args.seed)
    overrides = [*RUN, f"data.path={data}", f"run.steps={args.steps}", f"run.seed={args.seed}",
                 f"run.out_dir={ROOT / args.run_dir}", *([f"data.reward={args.reward}"] if args.reward else []),
                 *args.extra]
    started = time.time()
    done = subprocess.run([sys.executable, "recipes/smollm2_grpo_spec.py", *overrides], cwd=ROOT)
    wall = time.time() - started
    rows = read_metrics(ROOT / args.run_dir)
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    before = rows[0].get("eval_accuracy_before") if rows else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {
        "benchmark": "smollm2_data_learning", "machine": machine(), "commit": commit,
        "command": "python benchmarks/smollm2_data_learning.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "overrides": overrides, "returncode": done.returncode, "wall_s": wall, "steps_done": len(rows),
        "eval_accuracy_before": before, "eval_accuracy_last": evals[-1] if evals else None,
        "gain_points": None if before is None or not evals else round(100 * (evals[-1] - before), 1),
        "eval_accuracy": [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None],
        "train_accuracy": [r["accuracy"] for r in rows], "acceptance_length": [r["acceptance_length"] for r in rows],
        "drafter_loss": [r.get("drafter_loss") for r in rows], "step_time": [r["step_time"] for r in rows],
        "reward_timeouts": sum(r.get("reward_timeouts", 0) for r in rows), "rows": rows,
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    fig = figure(rows, out.with_suffix(".png"))
    print(json.dumps({k: record[k] for k in ("eval_accuracy_before", "eval_accuracy", "gain_points", "wall_s")}))
    print(f"record: {out}" + (f", figure: {fig}" if fig else ""))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
