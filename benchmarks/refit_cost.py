"""What a refit costs the next rollout: the engine's packed weights are rebuilt after every weight change.

An RL loop refits the generator every step, so every rollout starts on changed weights. One engine (plain decoding
or k = 3 with the MTP head) on the main job's policy, in one process: `--rounds` pairs of the main job's rollout
(8 prompts x 8 samples, T = 1, up to 160 tokens, the same prompts and seed in both), one on unchanged weights and
one right after an in-place update that changes no value but bumps every weight's version, as an optimizer step or
a refit's `copy_` does, the order alternating. Printed and written: the median rollout time of each, their
difference (what the refit costs), and the seconds spent making packs.

    python benchmarks/refit_cost.py --checkpoint runs/tiny/checkpoints/step_000029/state.pt --out refit_cost.json
"""

from __future__ import annotations

import time
from statistics import median

import torch

from megatron_spec.bench.common import MAIN_JOB_POLICY, main_job_models, main_job_parser, main_job_record
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import packed
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.rl.train_drafter import task_prompts


def main() -> int:
    parser = main_job_parser(__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=0, help="drafts a step (0: plain decoding)")
    args = parser.parse_args()
    policy, head = main_job_models(args.threads, args.checkpoint)
    spec = SpecConfig("mtp", args.k, adaptive=False) if args.k else None
    engine = LLMEngine(policy, max_num_seqs=64, spec=spec, drafter=head if args.k else None)
    batch = [q for q in task_prompts(MAIN_JOB_POLICY, 8, seed=100) for _ in range(8)]
    params = SamplingParams(temperature=1.0, max_tokens=160, seed=0)
    making = [0.0]
    make_pack = packed.make_pack

    def timed_make_pack(*a, **kw):
        start = time.perf_counter()
        out = make_pack(*a, **kw)
        making[0] += time.perf_counter() - start
        return out

    packed.make_pack = timed_make_pack
    seconds = {"unchanged": [], "refit": []}
    for r in range(args.rounds + 1):
        for kind in ("unchanged", "refit") if r % 2 else ("refit", "unchanged"):
            if kind == "refit":
                with torch.no_grad():
                    for p in list(policy.parameters()) + list(head.parameters()):
                        p.add_(0.0)
            start = time.perf_counter()
            engine.generate(batch, params)
            if r:  # round 0 warms up
                seconds[kind].append(time.perf_counter() - start)
    main_job_record("refit_cost", args, k=args.k, seconds=seconds, median_unchanged_s=median(seconds["unchanged"]),
                    median_refit_s=median(seconds["refit"]),
                    refit_cost_ms=1e3 * (median(seconds["refit"]) - median(seconds["unchanged"])),
                    packs_made_s=making[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
