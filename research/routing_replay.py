"""How far apart are the engine's and the trainer's log-probs of a tiny MoE's rollouts with and without routing replay?

The trained tiny MoE (`checkpoints/tiny-qwen3-moe`, 4 layers of 8 experts, top-2) generates a GRPO step's rollouts
(8 task prompts x 8, temperature 1, up to 96 tokens) on our engine with its routing recorded; each trainer (the
embedded one, and Megatron-Core's on one gloo rank; fp32) computes their log-probs twice, routing by itself and
replaying the engine's routing (`grpo.routing_replay`).
Per step: `logprob_mismatch` (the loop's metric: the largest |trainer - engine| over the generated tokens), the mean
|trainer - engine|, and the share of (position, MoE layer) choices where the trainer's own top-k differs from the
engine's (with replay it is 0 by construction: checked). Two engines: fp32 (the CPU default, the trainer's
precision) and bf16 (a GPU engine's precision against an fp32 trainer). `--generator vllm`: the rollouts and their
routing come from a vLLM engine (`VLLMGenerator(record_routing=True)`, the checkpoint in each dtype) instead. No
timing: any machine gives the same figures up to rounding.

    python research/routing_replay.py --steps 5 --out research/records/routing_replay.json
    python research/routing_replay.py --steps 5 --generator vllm --out research/records/routing_replay_vllm.json
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
from megatron_spec.generators.embedded import EmbeddedGenerator
from megatron_spec.rl.loop import make_batch
from megatron_spec.trainers.embedded import EmbeddedPolicy
from megatron_spec.rl.train_drafter import task_prompts

POLICY = "checkpoints/tiny-qwen3-moe"
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


GRPO = GRPOSection(micro_batch_tokens=0, routing_replay=True)
"""One micro-batch per forward: the routers' last forward then covers the whole batch."""


def rollouts(generator, prompts: list[list[int]], seed: int):
    """One step's rollouts from `generator` (recording routing): (batch, the engine's log-probs)."""
    outs = generator.generate(prompts, SamplingParams(max_tokens=96, seed=seed, **SAMPLING))
    return make_batch(prompts, outs)


def vllm_engine(dtype: str):
    """A vLLM engine serving the checkpoint in `dtype`, recording routing."""
    from megatron_spec.generators.vllm import VLLMGenerator

    return VLLMGenerator(POLICY, max_model_len=512, record_routing=True, dtype=dtype)


def with_routing(batch, routing):
    """`batch` with `routing` (None: the trainer routes by itself)."""
    b = copy.copy(batch)
    b.routing = routing
    return b


def measure(run, batch, behaviour) -> dict:
    """The trainer's log-probs of a step's rollouts, free and replayed (`run(batch, like)` -> log-probs and its
    routers' choices, laid out as `like`: [B, T, layers, k]), against the engine's."""
    recorded = batch.routing[..., 0, 0] >= 0
    engine_choice = batch.routing.long().sort(-1).values
    completion = batch.mask[:, 1:]
    out = {"tokens": int(completion.sum())}
    for name, routing in (("free", None), ("replay", batch.routing)):
        lp, trainer = run(with_routing(batch, routing), batch.routing)
        gap = (lp - behaviour).abs()[completion]
        differ = (trainer.long().sort(-1).values != engine_choice).any(-1)[recorded]
        out[name] = {"logprob_mismatch": float(gap.max()), "mean_abs": float(gap.mean()),
                     "routing_differs": float(differ.float().mean())}
    assert out["replay"]["routing_differs"] == 0.0
    return out


def embedded(model):
    """The embedded trainer's `run` for `measure`."""
    policy = EmbeddedPolicy(model, GRPO, SAMPLING)

    def run(batch, like):
        [(rows, mb)] = policy.split(batch)
        lp = policy.logprobs(batch)
        got = torch.full_like(like, -1)
        got[rows, : mb.input_ids.shape[1]] = choices(policy.model, len(rows), mb.input_ids.shape[1])
        return lp, got

    return run


def megatron_rank(rank: int, world: int, steps: list) -> list[dict]:
    """On one gloo rank: Megatron-Core's trainer (TP1, fp32) measured on each step's (batch, engine log-probs)."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.megatron.routing import last_routing

    policy = MegatronPolicy(from_pretrained(POLICY), GRPO, SAMPLING, Parallelism())

    def run(batch, like):
        [micro] = policy._micros(batch)
        lp = policy.logprobs(batch)
        got = torch.full_like(like, -1)
        length = micro.batch.input_ids.shape[1]
        got[micro.rows, :length] = last_routing(policy.routing, len(micro.rows), length).to(got.dtype)
        return lp, got

    return [measure(run, batch, behaviour) for batch, behaviour in steps]


def summary(steps: list[dict]) -> dict:
    """Median and largest per-step figure, free and replayed."""
    return {name: {k: {"median": statistics.median(s[name][k] for s in steps), "max": max(s[name][k] for s in steps)}
                   for k in ("logprob_mismatch", "mean_abs", "routing_differs")} for name in ("free", "replay")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--generator", choices=("embedded", "vllm"), default="embedded")
    args = ap.parse_args()
    from megatron_spec.trainers.megatron.parallel import spawn

    torch.manual_seed(0)
    trainer_model = from_pretrained(POLICY)
    record = {"question": __doc__.split("\n")[0], "machine": machine(), "policy": POLICY,
              "generator": args.generator,
              "command": f"python research/routing_replay.py --steps {args.steps} --generator {args.generator}"
                         + (f" --out {args.out}" if args.out else ""),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "torch_threads": torch.get_num_threads(), "engines": {}}
    for dtype in ("float32", "bfloat16"):
        steps = []
        vllm = vllm_engine(dtype) if args.generator == "vllm" else None
        for step in range(args.steps):
            prompts = [p for p in task_prompts(POLICY, 8, seed=step) for _ in range(8)]
            generator = vllm or EmbeddedGenerator(copy.deepcopy(trainer_model).to(getattr(torch, dtype)),
                                                  record_routing=True, own=True)
            steps.append(rollouts(generator, prompts, seed=1000 + step))
        if vllm is not None:
            vllm.close()
        run = embedded(trainer_model)
        trainers = {"embedded": [measure(run, batch, behaviour) for batch, behaviour in steps],
                    "megatron": spawn(megatron_rank, 1, steps)[0]}
        record["engines"][dtype] = {name: {"steps": got, "summary": summary(got)} for name, got in trainers.items()}
        for name, got in trainers.items():
            print(dtype, name, json.dumps(record["engines"][dtype][name]["summary"]))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
