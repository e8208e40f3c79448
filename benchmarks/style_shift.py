"""What RL changed in the main job's text: the share of careful solutions and the accuracy of each style.

The main job's policy was pretrained on a corpus where 2 % of solutions come from a careful writer who works each
units column first (`47+38:7+8=15,85`) and is right, and the rest from a hurried one who drops 90 % of carries
(`megatron_spec/tasks/arithmetic.py`). For the shipped checkpoint and for the last checkpoint of each run given,
this samples the held-out problems (greedy once, and 8 times at T = 1 with the engine) and counts, per style, how
many solutions there are and how many are right. A solution is careful when its first line has the units column.

    python benchmarks/style_shift.py runs/main_job_bench/spec-s0 ... --out research/records/main_job_style_shift.json

No timing: the figures are counts, the same on any machine up to float reduction order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_spec.bench.common import MAIN_JOB_POLICY

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / MAIN_JOB_POLICY


def styles(model, problems, samples: int, temperature: float, seed: int) -> dict:
    from megatron_spec.engine import LLMEngine, SamplingParams
    from megatron_spec.tasks.reward import reward
    from megatron_spec.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompts = [tok.encode(p.prompt, bos=True) for p in problems for _ in range(samples)]
    answers = [p.answer for p in problems for _ in range(samples)]
    outs = LLMEngine(model, max_num_seqs=len(prompts)).generate(
        prompts, SamplingParams(temperature=temperature, max_tokens=160, seed=seed))
    texts = [tok.decode(o.token_ids) for o in outs]
    careful = [":" in t.split("\n")[0] for t in texts]
    right = [reward(t, a) == 1.0 for t, a in zip(texts, answers)]

    def share(flags, among):
        n = sum(among)
        return sum(f and a for f, a in zip(flags, among)) / n if n else None

    everyone = [True] * len(texts)
    return {"solutions": len(texts), "careful_share": share(careful, everyone), "accuracy": share(right, everyone),
            "accuracy_careful": share(right, careful), "accuracy_hurried": share(right, [not c for c in careful]),
            "mean_chars": sum(map(len, texts)) / len(texts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", help="run directories whose last checkpoint to measure")
    p.add_argument("--problems", type=int, default=128, help="held-out problems (the main job's eval set)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.rl.checkpoint import load_latest
    from megatron_spec.rl.task import trained_difficulty
    from megatron_spec.tasks.arithmetic import ArithmeticDataset

    torch.set_num_threads(2)
    problems = list(ArithmeticDataset(args.problems, seed=0, difficulty=trained_difficulty(str(POLICY)), split="eval"))
    rows = []
    for name in ["shipped", *args.runs]:
        model = from_pretrained(POLICY)
        if name != "shipped":
            saved = load_latest(Path(name))
            if saved is None:
                raise SystemExit(f"{name} has no checkpoint")
            model.load_state_dict(saved["state"]["model"])
        row = {"policy": name, "greedy": styles(model, problems, 1, 0.0, 0),
               "sampled": styles(model, problems, 8, 1.0, 1)}
        rows.append(row)
        g, s = row["greedy"], row["sampled"]
        print(f"{name}: careful share greedy {g['careful_share']:.3f}, T=1 {s['careful_share']:.3f}; accuracy T=1 "
              f"careful {s['accuracy_careful']}, hurried {s['accuracy_hurried']}; greedy accuracy {g['accuracy']:.3f}")
    if args.out:
        from megatron_spec.bench.common import machine

        record = {"machine": machine(), "problems": args.problems, "policy": str(POLICY.relative_to(ROOT)),
                  "rows": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
