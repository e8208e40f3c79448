"""Where the main job's rollout time goes, per batch-size octave, with and without k = 3: how much of the gen stage
each octave holds, what a k = 3 step costs there in plain steps, and its parts.

Two engines on one policy and MTP head (the shipped pair, or a main-job checkpoint's with `--checkpoint`): plain
decoding and k = 3 on every step. One untimed round, then `--rounds` rounds of the main job's rollout shape
(8 prompts x 8 samples, T = 1, up to 160 tokens, stopping at EOS, new prompts each round), both engines once a
round, the order reversing each round. Every step is timed whole; a decode step also in its parts (`propose`, the
target's `verify` forward, `accept`) and by its batch size's octave (1, 2, 3-4, ..., 33-64 sequences).

Per octave, printed and written: the plain run's decode seconds and their share of its gen stage; a plain step's
ms; a k = 3 step's ms and parts; `rho`, the median over k = 3 steps of each step's time over the plain steps' median
at the same batch size (what `AdaptiveController` measures); tokens a sequence a k = 3 step emits; and their
quotient, what k = 3 gains there over plain decoding. Prefill steps are reported on their own line. k = 3 and plain
decoding sample different tokens, so the two runs' batches drain along different paths: compare octaves, not steps.

    python research/octave_parts.py --checkpoint runs/tiny/checkpoints/step_000029/state.pt --rounds 8 \\
        --out research/records/octave_parts.json
"""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import median

from megatron_spec.bench.common import (STEP_PARTS as PARTS, alternating_rounds, main_job_models, main_job_parser,
                                        main_job_record, time_step_parts)
from megatron_spec.engine import LLMEngine
from megatron_spec.speculative.adaptive import octave
from megatron_spec.drafters.config import SpecConfig


def summary(plain: list, spec: list) -> dict:
    by_size = defaultdict(list)
    for batch, seconds, _, _ in plain:
        if batch:
            by_size[batch].append(seconds)
    plain_median = {b: median(s) for b, s in by_size.items()}
    gen = sum(s for _, s, _, _ in plain)
    out = {"prefill": {"plain_s": sum(s for b, s, _, _ in plain if b is None),
                       "k3_s": sum(s for b, s, _, _ in spec if b is None)}}
    out["prefill"]["share_of_plain_gen"] = out["prefill"]["plain_s"] / gen
    for o in sorted({octave(b) for b, *_ in plain + spec if b}):
        mine = [(b, s, p, t) for b, s, p, t in plain if b and octave(b) == o]
        theirs = [(b, s, p, t) for b, s, p, t in spec if b and octave(b) == o]
        if not mine or not theirs:
            continue
        ratios = [s / plain_median[b] for b, s, _, _ in theirs if b in plain_median]
        tokens = sum(t for *_, t in theirs) / sum(b for b, *_ in theirs)
        rho = median(ratios) if ratios else None
        out[f"octave_{o}"] = {
            "batch": f"{(1 << (o - 1)) + 1 if o else 1}-{1 << o}",
            "plain_s": sum(s for _, s, _, _ in mine), "share_of_plain_gen": sum(s for _, s, _, _ in mine) / gen,
            "plain_step_ms": 1e3 * sum(s for _, s, _, _ in mine) / len(mine), "k3_steps": len(theirs),
            "k3_step_ms": 1e3 * sum(s for _, s, _, _ in theirs) / len(theirs),
            **{f"k3_{p}_ms": 1e3 * sum(parts[p] for _, _, parts, _ in theirs) / len(theirs) for p in PARTS},
            "plain_verify_ms": 1e3 * sum(parts["verify"] for _, _, parts, _ in mine) / len(mine),
            "rho": rho, "k3_tokens_per_seq_step": tokens, "k3_gain": tokens / rho if rho else None,
        }
    return out


def main() -> int:
    args = main_job_parser(__doc__.splitlines()[0]).parse_args()
    policy, head = main_job_models(args.threads, args.checkpoint)
    runs = {"plain": LLMEngine(policy, max_num_seqs=64),
            "k3": LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=False), drafter=head)}
    steps = {name: [] for name in runs}
    seconds = Counter()
    for r, this in alternating_rounds(runs, args.rounds):
        if r == 0:  # time the steps of the rounds after the warm-up
            for name, engine in runs.items():
                time_step_parts(engine, steps[name])
        else:
            seconds.update(this)
    main_job_record("octave_parts", args, seconds=dict(seconds), k3_over_plain=seconds["plain"] / seconds["k3"],
                    octaves=summary(steps["plain"], steps["k3"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
