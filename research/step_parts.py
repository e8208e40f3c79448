"""Where a speculative decode step's time goes, against a plain one, per batch size: the main job's policy and MTP
head (the shipped pair), fixed k (no adaptive controller).

For each batch size B and k in (0, 1, 3): a fresh engine, one untimed rollout, then `--repeats` rollouts of B
sequences (main-job prompts, T = 1, EOS ignored so the batch stays at B, `--tokens` new tokens each). Every decode
step is timed whole and in its parts: drafting (`propose`, the head's catch-up and chained rounds), the target's
verify forward, acceptance (`accept`: rejection sampling, rollback, bookkeeping) and the rest (the proposer
observing the forward, appending tokens). Prefill steps are left out. Printed and written: ms a step and per part,
tokens a step, and the cost of a step at k in plain steps, which is the acceptance length (tokens a step) that k
must reach to break even.

    python research/step_parts.py --batch 1 4 16 64 --out research/records/step_parts.json

Timings on a shared host wander between runs; the ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_spec.bench.common import (MAIN_JOB_DRAFTER, MAIN_JOB_POLICY, STEP_PARTS as PARTS, machine,
                                        main_job_models, time_step_parts)
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.rl.train_drafter import task_prompts

TARGET, DRAFTER = MAIN_JOB_POLICY, MAIN_JOB_DRAFTER
def measure(policy, head, batch: int, k: int, tokens: int, repeats: int) -> dict:
    spec = SpecConfig("mtp", k, adaptive=False) if k else None
    engine = LLMEngine(policy, max_num_seqs=batch, spec=spec, drafter=head if k else None)
    prompts = task_prompts(TARGET, batch, seed=7)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True))
    steps: list = []
    time_step_parts(engine, steps)
    emitted = 0
    for r in range(repeats):
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=tokens, seed=1 + r, ignore_eos=True))
        emitted += sum(len(o.token_ids) for o in outs) - len(outs)  # the first token of each comes from prefill
    decodes = [(seconds, parts) for batch_size, seconds, parts, _ in steps if batch_size]  # prefill steps left out
    n = len(decodes)
    parts = {p: 1e3 * sum(step[p] for _, step in decodes) / n for p in PARTS}
    step_ms = 1e3 * sum(seconds for seconds, _ in decodes) / n
    return {"batch": batch, "k": k, "steps": n, "step_ms": step_ms, **{f"{p}_ms": v for p, v in parts.items()},
            "rest_ms": step_ms - sum(parts.values()), "tokens_per_step": emitted / n / batch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    policy, head = main_job_models(args.threads)
    rows = []
    for batch in args.batch:
        plain = None
        for k in (0, 1, 3):
            row = measure(policy, head, batch, k, args.tokens, args.repeats)
            plain = plain or row
            row["cost_in_plain_steps"] = row["step_ms"] / plain["step_ms"]
            row["speedup"] = row["tokens_per_step"] / row["cost_in_plain_steps"]
            rows.append(row)
            print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                           for key, val in row.items()), flush=True)
    if args.out:
        result = {"benchmark": "step_parts", "machine": machine(), "target": TARGET, "drafter": DRAFTER,
                  "rollout": f"B sequences, T=1, EOS ignored, {args.tokens} new tokens, {args.repeats} timed repeats",
                  "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
