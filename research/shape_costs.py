"""Three costs behind the adaptive controller's losses on CPU, measured: what the fixes in `packed.ROW_MULTIPLE`,
`kv_cache.KV_BLOCK` and `LLMEngine.time_step` are for.

1. `new_row_count`: oneDNN builds a kernel per GEMM row count. A forward of the deep tiny model
   (`checkpoints/tiny-qwen3-deep-careful`, 8 layers, no cache) at a row count it has not met, against the same
   forward again, with `ROW_MULTIPLE` padding off (every count new) and on (counts that pad to a met one).
2. `attention_shapes`: 30 layers' q.k^T of SmolLM2's shapes (3 KV heads of 3 queries, head dim 64) over a key
   prefix that grows by one key per step (a new shape each step) against one of fixed length, fp32 and bf16.
3. `plain_after_drafting`: the draft model (`checkpoints/tiny-draft`) on the deep tiny model at B=8, T=1, with a
   scripted choice of k: the steps of plain decoding that follow a drafting step against those that follow a plain
   step (the verify part, which is what the controller timed as plain decoding's cost).

    python research/shape_costs.py --out research/records/shape_costs.json

Timings; medians over repeats on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_spec.bench.common import MAIN_JOB_POLICY

ROOT = Path(__file__).resolve().parents[1]
TARGET = str(ROOT / MAIN_JOB_POLICY)


def new_row_count(model, padded: bool) -> dict:
    """Milliseconds of a no-cache forward at row counts 9..40 (B=1, T=rows): first call, then again."""
    import megatron_spec.models.packed as packed

    saved = packed.ROW_MULTIPLE
    packed.ROW_MULTIPLE = 8 if padded else 10**9
    first, again = [], []
    try:
        with torch.inference_mode():
            for rows in range(9, 41):
                ids = torch.randint(0, model.config.vocab_size, (1, rows))
                for out in (first, again):
                    t0 = time.perf_counter()
                    model(ids)
                    out.append(time.perf_counter() - t0)
    finally:
        packed.ROW_MULTIPLE = saved
    return {"padded": padded, "first_ms": 1e3 * statistics.median(first), "again_ms": 1e3 * statistics.median(again)}


def attention_shapes(dtype: torch.dtype, steps: int = 200, layers: int = 30) -> dict:
    keys = torch.randn(1, 3, 100 + steps, 64, dtype=dtype)
    q = torch.randn(1, 3, 3, 64, dtype=dtype)

    def per_step(lengths) -> float:
        t = 0.0
        for n in lengths:
            k = keys[:, :, :n].transpose(-1, -2)
            t0 = time.perf_counter()
            for _ in range(layers):
                q @ k
            t += time.perf_counter() - t0
        return 1e3 * t / len(lengths)

    growing = per_step(range(100, 100 + steps))  # each length met for the first time
    fixed = per_step([100 + steps] * steps)
    return {"dtype": str(dtype).removeprefix("torch."), "growing_ms": growing, "fixed_ms": fixed}


def plain_after_drafting(model, repeats: int) -> dict:
    """Verify-part times of plain steps by what the step before was, under a script of k per step."""
    from megatron_spec.engine import LLMEngine, SamplingParams
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.rl.train_drafter import task_prompts

    prompts = task_prompts(TARGET, 8, seed=1008, split="bench")
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=8)
    after = {"drafting": [], "plain": []}
    for r in range(repeats):
        spec = SpecConfig("draft_model", 1, model=str(ROOT / "checkpoints" / "tiny-draft"), adaptive=True)
        engine = LLMEngine(model, max_num_seqs=8, spec=spec)
        script = itertools.cycle([1, 1, 0, 0])  # plain steps: half after a drafting step, half after a plain one
        engine.controller.choose_k = lambda batch: next(script)
        last = {"k": None}

        def record(batch, tokens, seconds, last=last):
            if tokens == 1 and last["k"] is not None:
                after["drafting" if last["k"] else "plain"].append(seconds)
            last["k"] = tokens - 1

        engine.time_step = lambda batch, k, tokens, after_drafting, started, verified: record(
            batch, k + 1, time.perf_counter() - verified)
        engine.generate(prompts, params)
    return {"batch": 8, "after_drafting_ms": 1e3 * statistics.median(after["drafting"]),
            "after_plain_ms": 1e3 * statistics.median(after["plain"]),
            "steps": [len(after["drafting"]), len(after["plain"])]}


def main(argv: list[str] | None = None) -> int:
    from megatron_spec.bench.common import machine, write_json
    from megatron_spec.models import from_pretrained

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model = from_pretrained(TARGET)
    # Padded first: the few row counts it pads to are new to it, which they would not be after the unpadded run.
    result = {"benchmark": "shape_costs", "machine": machine(),
              "new_row_count": [new_row_count(model, padded=True), new_row_count(model, padded=False)],
              "attention_shapes": [attention_shapes(torch.float32), attention_shapes(torch.bfloat16)],
              "plain_after_drafting": plain_after_drafting(model, args.repeats)}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
