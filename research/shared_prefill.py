"""Sequences that share a prompt sharing its prefill (`ModelRunner.prefill`), against each sequence prefilling its own
copy, on the main job's rollouts, in one process.

Six engines on one policy and MTP head (the shipped pair, or a main-job checkpoint's with `--checkpoint`): plain
decoding, k = 3 on every step, and the adaptive controller (k_max 3), each with the shared prefill and with it
undone (every sequence's prompt runs through the trunk, as before it). One untimed round, then `--rounds` rounds of
the main job's rollout shape (8 prompts x 8 samples, T = 1, up to 160 tokens, stopping at EOS, new prompts each
round), every engine once a round, the order reversing each round. Printed and written: seconds per engine, the
shared prefill's speed-up per decoding mode, and each speculative mode over plain decoding with and without it.

    python research/shared_prefill.py --checkpoint runs/tiny/checkpoints/step_000029/state.pt --rounds 16 \\
        --out research/records/shared_prefill.json
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from megatron_spec.bench.common import (MAIN_JOB_DRAFTER, MAIN_JOB_POLICY, alternating_rounds, machine,
                                        main_job_models, main_job_parser)
from megatron_spec.engine import LLMEngine
from megatron_spec.drafters.config import SpecConfig

MODES = ("plain", "k3", "adaptive")


def unshared(engine: LLMEngine) -> LLMEngine:
    """The engine with every sequence prefilling its own prompt (the runner as it was before the shared prefill)."""
    start = engine.start

    def started(*args, **kwargs):
        seqs = start(*args, **kwargs)
        runner = engine.runner

        def prefill(batch):
            out = runner.forward(batch, [s.prompt for s in batch])
            last = torch.tensor([len(s.prompt) - 1 for s in batch])
            return runner.logits(out.hidden[torch.arange(len(batch)), last]), out

        runner.prefill = prefill
        return seqs

    engine.start = started
    return engine


def engine(policy, head, mode: str) -> LLMEngine:
    if mode == "plain":
        return LLMEngine(policy, max_num_seqs=64)
    return LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=mode == "adaptive"), drafter=head)


def main() -> int:
    args = main_job_parser(__doc__.splitlines()[0]).parse_args()
    policy, head = main_job_models(args.threads, args.checkpoint)
    runs = {}
    for mode in MODES:
        runs[mode] = engine(policy, head, mode)
        runs[f"{mode}_unshared"] = unshared(engine(policy, head, mode))
    seconds = Counter()
    for r, this in alternating_rounds(runs, args.rounds):
        if r:
            seconds.update(this)
            print(f"round {r}: " + " ".join(f"{n} {t:.3f}s" for n, t in this.items()), flush=True)
    result = {
        "benchmark": "shared_prefill", "machine": machine(), "target": MAIN_JOB_POLICY, "drafter": MAIN_JOB_DRAFTER,
        "checkpoint": args.checkpoint, "rollout": "8 prompts x 8 samples, T=1, max 160 tokens, EOS stops",
        "rounds": args.rounds, "seconds": dict(seconds),
        "shared_over_unshared": {m: seconds[f"{m}_unshared"] / seconds[m] for m in MODES},
        "over_plain": {"shared": {m: seconds["plain"] / seconds[m] for m in MODES[1:]},
                       "unshared": {m: seconds["plain_unshared"] / seconds[f"{m}_unshared"] for m in MODES[1:]}},
    }
    print(json.dumps({k: result[k] for k in ("shared_over_unshared", "over_plain")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
