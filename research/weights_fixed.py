"""What checking each fused plan against its layer's parameters on every forward cost: `LLMEngine.generate` (plans
checked once a call, inside `decoder.weights_fixed`) against the same engine's steps run without that block (checked
on every forward), in one process, alternating, plain decoding at T = 1.

Models: the main job's policy (`checkpoints/tiny-qwen3-deep-careful`, 8 layers) at B = 1 / 8 / 64, 100 new tokens,
and SmolLM2-135M (30 layers) at B = 1, 32 new tokens. Printed and written: per cell the sorted ratios of `--repeats`
pairs (time without the block over time with it) and their median.

    python research/weights_fixed.py --out research/records/weights_fixed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from megatron_spec.bench.common import MAIN_JOB_POLICY, machine, main_job_models
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.rl.train_drafter import task_prompts


def checked_every_forward(engine: LLMEngine, prompts, params) -> None:
    """`generate`'s steps without its `weights_fixed` block."""
    engine.start(prompts, params)
    with torch.inference_mode():
        while not engine.scheduler.is_finished():
            engine.step()


def pairs(model, prompts, max_tokens: int, repeats: int) -> list[float]:
    engine = LLMEngine(model, max_num_seqs=64)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, ignore_eos=True)
    engine.generate(prompts, params)  # untimed: caches, packs and plans made
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        checked_every_forward(engine, prompts, params)
        every = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(prompts, params)
        ratios.append(every / (time.perf_counter() - start))
    return sorted(ratios)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    policy, _ = main_job_models(args.threads)
    cells = {f"tiny-qwen3-deep-careful B={b}": pairs(policy, task_prompts(MAIN_JOB_POLICY, b, seed=5), 100,
                                                    args.repeats) for b in (1, 8, 64)}
    smollm2 = from_pretrained("smollm2-135m", dtype=torch.float32)
    cells["smollm2-135m B=1"] = pairs(smollm2, [[1] + list(range(100, 131))], 32, args.repeats)
    result = {"benchmark": "weights_fixed", "machine": machine(),
              "cells": {name: {"ratios": r, "median": statistics.median(r)} for name, r in cells.items()}}
    for name, cell in result["cells"].items():
        print(f"{name}: checked every forward / once a call = {cell['median']:.3f}x "
              f"({', '.join(f'{r:.3f}' for r in cell['ratios'])})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
