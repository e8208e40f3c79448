"""One RL step's online drafter training at several `drafter_train.minibatches`, side by side in one process.

The main job's policy and MTP head (drafts 3, replay 4): four steps' 32 trained rows each (16-token prompts,
responses of random lengths in a range), cut into the policy's micro-batches (`grpo.micro_batch_tokens` 2048),
their trunk states computed once; one RL step's update (every replayed step dealt into `minibatches`, an optimizer
step each) is timed per setting, the order rotating each round. Prints and writes the median time of each.

    python research/drafter_freshness/timing.py --out research/records/drafter_freshness_timing.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_spec.bench.common import machine, main_job_models, write_json
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
from megatron_spec.drafters.trainer import minibatches
from megatron_spec.trainers.embedded import EmbeddedPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/: the synthetic drafter inputs
from drafter_update import step_inputs  # noqa: E402

BUDGET = 2048
"""The main job's `grpo.micro_batch_tokens`."""
PROMPT = 16
"""BOS and an addition chain: about 16 tokens."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranges", nargs="+", default=["10-80", "30-160"], help="response lengths, lo-hi")
    p.add_argument("--minibatches", nargs="+", type=int, default=[8, 2, 1])
    p.add_argument("--replay", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="research/records/drafter_freshness_timing.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model, drafter = main_job_models(args.threads)
    policy = EmbeddedPolicy(model, GRPOSection(lr=1e-4), dict(temperature=1.0, top_k=0, top_p=1.0), drafter, "mtp",
                            DrafterTrainSection(drafts=3, replay=args.replay))
    rng, rows = random.Random(0), []
    for spec in args.ranges:
        lo, hi = map(int, spec.split("-"))
        steps = []
        for _ in range(args.replay):
            forwards = step_inputs(model, [PROMPT + rng.randint(lo, hi) for _ in range(32)], PROMPT, BUDGET)
            steps.append((forwards, float(sum(f.mask.sum() for f in forwards))))
        times: dict[int, list[float]] = {m: [] for m in args.minibatches}
        for rep in range(args.repeats + 1):
            order = args.minibatches[rep % len(args.minibatches):] + args.minibatches[:rep % len(args.minibatches)]
            for m in order:
                start = time.perf_counter()
                for forwards, tokens in steps:
                    for parts, count in minibatches(forwards, tokens, m, BUDGET):
                        policy.drafter_trainer.run_pass(model, parts, count, learn=True, measure=False)
                if rep:  # the first round warms every setting up
                    times[m].append(time.perf_counter() - start)
        row = {"responses": spec, **{f"minibatches_{m}_s": statistics.median(times[m]) for m in args.minibatches}}
        rows.append(row)
        print(f"responses {spec}: " + ", ".join(f"{m} minibatches {row[f'minibatches_{m}_s']:.3f} s"
                                                 for m in args.minibatches))
    record = {"benchmark": "drafter_freshness_timing", "command": "python research/drafter_freshness/timing.py",
              "machine": machine(), "replay": args.replay,
              "rows_per_step": 32, "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
