"""How far the adaptive controller's estimates lie from what its steps cost and emit, per batch-size octave, on the
main job's rollouts: the inputs of its decision (`AdaptiveController.speedups`, E_k / rho_k), each against the same
quantity measured beside it.

Two engines on one policy and MTP head (the shipped pair, or a main-job checkpoint's with `--checkpoint`): plain
decoding and the adaptive controller (k_max = 3, its margin `--margin`, the shipped one by default), both once a
round over the main job's rollout shape, the order alternating (`alternating_rounds`), every step timed. Per octave:

- `plain_time_over_true`: the controller's plain reference at each batch size the plain engine met in the octave
  (`plain_time`: its own latest plain steps there, else the line between the nearest sizes it timed), over the
  plain engine's median step at that size; the median over those sizes. Below 1 it prices speculation dearer.
- `rho` and `true_rho`, for the octave's most used k >= 1: the controller's ratio at the end (`_ratio`) and the
  median over the controller's steps at that k of their time over the plain engine's median at the same size;
  `switching`, the catch-ups' cost the controller adds to rho (plain steps, spread over its speculative steps).
- `expected_tokens` and `tokens`: E_k as the controller estimated it when it chose each of those steps (mean), and
  what they emitted, tokens a sequence a step.
- `gain`: what the controller's decision reads at the end (`speedups`: E at the end over rho + switching);
  `true_gain`: tokens / true_rho (switching not included: the catch-ups fall in steps its k counts); `choices`:
  steps per k.

    python research/controller_bias.py --checkpoint runs/tiny/checkpoints/step_000029/state.pt --rounds 8 \\
        --out research/records/controller_bias.json
"""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import mean, median

from megatron_spec.bench.common import (alternating_rounds, main_job_models, main_job_parser, main_job_record,
                                        record_choices, time_step_parts)
from megatron_spec.engine import LLMEngine
from megatron_spec.speculative.adaptive import octave
from megatron_spec.drafters.config import SpecConfig


def summary(controller, plain_steps: list, adaptive_steps: list, chosen: list) -> dict:
    by_size = defaultdict(list)
    for batch, seconds, _, _ in plain_steps:
        if batch:
            by_size[batch].append(seconds)
    plain = {b: median(s) for b, s in by_size.items()}
    # The engine's decode steps and the controller's choices line up one to one (prefill steps are not chosen for).
    decode = [(b, s, t) for b, s, _, t in adaptive_steps if b]
    assert len(decode) == len(chosen), (len(decode), len(chosen))
    out = {}
    for o in sorted({octave(b) for b in plain}):
        cell = controller.octaves.get(o)
        sizes = [b for b in plain if octave(b) == o]
        row = {"batch": f"{(1 << (o - 1)) + 1 if o else 1}-{1 << o}",
               "plain_time_over_true": median(controller.plain_time(b) / plain[b] for b in sizes),
               "choices": dict(sorted(Counter(k for b, k, _ in chosen if octave(b) == o).items()))}
        mine = [(b, s, t, e, k) for (b, s, t), (_, k, e) in zip(decode, chosen) if octave(b) == o and k]
        if mine and cell is not None:
            k = Counter(k for *_, k in mine).most_common(1)[0][0]
            at_k = [(b, s, t, e) for b, s, t, e, kk in mine if kk == k and b in plain]
            rho = controller._ratio(cell, k)
            if at_k and rho:
                true_rho = median(s / plain[b] for b, s, _, _ in at_k)
                tokens = sum(t for _, _, t, _ in at_k) / sum(b for b, *_ in at_k)
                expected = mean(e for *_, e in at_k)
                row.update(k=k, steps=len(at_k), rho=rho, switching=cell.switching, true_rho=true_rho,
                           expected_tokens=expected, tokens=tokens, gain=controller.speedups(cell)[k],
                           true_gain=tokens / true_rho)
        out[f"octave_{o}"] = row
    return out


def main() -> int:
    p = main_job_parser(__doc__.splitlines()[0])
    p.add_argument("--margin", type=float, default=None, help="the controller's margin (default: the shipped one)")
    args = p.parse_args()
    policy, head = main_job_models(args.threads, args.checkpoint)
    runs = {"plain": LLMEngine(policy, max_num_seqs=64),
            "adaptive": LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=True), drafter=head)}
    controller = runs["adaptive"].controller
    if args.margin is not None:
        controller.margin = args.margin
    steps, chosen, seconds = {name: [] for name in runs}, [], Counter()
    for r, this in alternating_rounds(runs, args.rounds):
        if r == 0:  # the warm-up round's steps are not summarized, but the controller keeps what it learned
            for name, engine in runs.items():
                time_step_parts(engine, steps[name])
            record_choices(controller, chosen, expected=True)
        else:
            seconds.update(this)
    main_job_record("controller_bias", args, margin=controller.margin, seconds=dict(seconds),
                    adaptive_over_plain=seconds["plain"] / seconds["adaptive"],
                    octaves=summary(controller, steps["plain"], steps["adaptive"], chosen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
