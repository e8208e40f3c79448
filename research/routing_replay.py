"""How far apart are the engine's and the trainer's log-probs of a tiny MoE's rollouts with and without routing replay?

The trained tiny MoE (`checkpoints/tiny-qwen3-moe`, 4 layers of 8 experts, top-2) generates a GRPO step's rollouts
(8 task prompts x 8, temperature 1, up to 96 tokens) on our engine with its routing recorded; the embedded trainer
(fp32) computes their log-probs twice, routing by itself and replaying the engine's routing (`grpo.routing_replay`).
Per step: `logprob_mismatch` (the loop's metric: the largest |trainer - engine| over the generated tokens), the mean
|trainer - engine|, and the share of (position, MoE layer) choices where the trainer's own top-k differs from the
engine's (with replay it is 0 by construction: checked). Two engines: fp32 (the CPU default, the trainer's
precision) and bf16 (a GPU engine's precision against an fp32 trainer). No timing: any machine gives the same
figures up to rounding.

    python research/routing_replay.py --steps 5 --out research/records/routing_replay.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
from pathlib import Path

import torch

from megatron_spec.bench.common import machine
from megatron_spec.engine import SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.models.routing import choices
from megatron_spec.rl.config import GRPOSection
from megatron_spec.rl.generator import EmbeddedGenerator
from megatron_spec.rl.loop import make_batch
from megatron_spec.rl.policy import EmbeddedPolicy
from megatron_spec.spec.train_drafter import task_prompts

POLICY = "checkpoints/tiny-qwen3-moe"
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def one_step(engine_model, policy: EmbeddedPolicy, prompts: list[list[int]], seed: int) -> dict:
    """One step's rollouts from `engine_model` and the trainer's log-probs of them, free and replayed."""
    outs = EmbeddedGenerator(engine_model, record_routing=True, own=True).generate(
        prompts, SamplingParams(max_tokens=96, seed=seed, **SAMPLING))
    batch, behaviour = make_batch(prompts, outs)
    recorded = batch.routing[..., 0, 0] >= 0
    engine_choice = batch.routing.long().sort(-1).values
    [(rows, _)] = policy.split(batch)
    completion = batch.mask[:, 1:]
    out = {"tokens": int(completion.sum())}
    for name, routing in (("free", None), ("replay", batch.routing)):
        lp = policy.logprobs(with_routing(batch, routing))
        gap = (lp - behaviour).abs()[completion]
        trainer = torch.empty_like(batch.routing)
        trainer[rows] = choices(policy.model, len(rows), batch.routing.shape[1])
        differ = (trainer.long().sort(-1).values != engine_choice).any(-1)[recorded]
        out[name] = {"logprob_mismatch": float(gap.max()), "mean_abs": float(gap.mean()),
                     "routing_differs": float(differ.float().mean())}
    assert out["replay"]["routing_differs"] == 0.0
    return out


def with_routing(batch, routing):
    """`batch` with `routing` (None: the trainer routes by itself)."""
    b = copy.copy(batch)
    b.routing = routing
    return b


def summary(steps: list[dict]) -> dict:
    return {name: {k: {"median": statistics.median(s[name][k] for s in steps), "max": max(s[name][k] for s in steps)}
                   for k in ("logprob_mismatch", "mean_abs", "routing_differs")} for name in ("free", "replay")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    trainer_model = from_pretrained(POLICY)
    policy = EmbeddedPolicy(trainer_model, GRPOSection(micro_batch_tokens=0, routing_replay=True), SAMPLING)
    record = {"question": __doc__.split("\n")[0], "machine": machine(), "policy": POLICY,
              "command": f"python research/routing_replay.py --steps {args.steps}"
                         + (f" --out {args.out}" if args.out else ""),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "torch_threads": torch.get_num_threads(), "engines": {}}
    for dtype in ("float32", "bfloat16"):
        steps = []
        for step in range(args.steps):
            prompts = [p for p in task_prompts(POLICY, 8, seed=step) for _ in range(8)]
            engine = copy.deepcopy(trainer_model).to(getattr(torch, dtype))
            steps.append(one_step(engine, policy, prompts, seed=1000 + step))
        record["engines"][dtype] = {"steps": steps, "summary": summary(steps)}
        print(dtype, json.dumps(record["engines"][dtype]["summary"]))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
