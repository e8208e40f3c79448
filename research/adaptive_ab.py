"""The adaptive controller against plain decoding on the main job's rollouts, in one process, and what its
speculative steps cost.

Four engines on one policy and MTP head (the shipped pair, or a main-job checkpoint's with `--checkpoint`): plain
decoding; the speculative engine with the controller forced to plain decoding on every step (what holding the
head's states costs while speculation is off); the speculative engine under the adaptive controller (k_max 3); and
k = 3 on every step, no controller (`k3`). One untimed round, then `--rounds` rounds of the main job's rollout
shape (8 prompts x 8 samples, T = 1, up to 160 tokens, stopping at EOS, new prompts each round; `--prompts`,
`--samples`, `--max-tokens` and `--ignore-eos` change it), every engine once a round, the order reversing each
round. `--device cuda` runs it on a GPU (`benchmarks/gpu_checks.sh`, part `trace`). `--baseline-controller FILE`
adds a fifth engine, `baseline`, under the `AdaptiveController` of another version of `megatron_spec/speculative/adaptive.py`
(`git show REF:megatron_spec/speculative/adaptive.py > FILE`), so a change to the controller is timed against the one before
it in the same rounds.

For the adaptive engine every step is also timed by kind: plain, speculative, and the first drafting step after
plain ones (`catch-up`: the head runs over every position it skipped, for every sequence alive), which the
controller does not time as a speculative step. Printed and written: total seconds per engine, their ratios to
plain decoding, per-round ratios, the steps of each kind and their seconds, and the controller's choices per
batch-size octave.

    python research/adaptive_ab.py --checkpoint runs/tiny/checkpoints/step_000029/state.pt --rounds 8 \\
        --out research/records/adaptive_ab.json
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path

from megatron_spec.bench.common import (MAIN_JOB_DRAFTER, MAIN_JOB_POLICY, alternating_rounds, machine,
                                        main_job_models, main_job_parser, record_choices)
from megatron_spec.engine import LLMEngine
from megatron_spec.speculative.adaptive import octave
from megatron_spec.drafters.config import SpecConfig

TARGET, DRAFTER = MAIN_JOB_POLICY, MAIN_JOB_DRAFTER
ENGINES = ("plain", "held_plain", "adaptive", "k3")


def engines(policy, head, baseline: str | None = None) -> dict[str, LLMEngine]:
    out = {"plain": LLMEngine(policy, max_num_seqs=64)}
    for name in ENGINES[1:] + (("baseline",) if baseline else ()):
        out[name] = LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=name != "k3"), drafter=head)
    out["held_plain"].controller.choose_k = lambda batch: 0
    if baseline:
        out["baseline"].controller = load_module(baseline, "baseline_adaptive").AdaptiveController(3)
    return out


def load_module(path: str, name: str):
    """The Python file at `path` as module `name` (registered, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def watch(engine: LLMEngine, steps: list) -> None:
    """Append (batch, k, kind, seconds) for each of the engine's decode steps to `steps`."""
    step, chosen = engine.step, []
    record_choices(engine.controller, chosen)

    def timed():
        before, caught_up, t0 = len(chosen), engine.drafted_last, time.perf_counter()
        step()
        if len(chosen) > before:  # a decode step (prefill chooses nothing)
            batch, k = chosen[-1]
            kind = "plain" if k == 0 else ("speculative" if caught_up else "catch-up")
            steps.append((batch, k, kind, time.perf_counter() - t0))

    engine.step = timed


def main() -> int:
    p = main_job_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (a GPU session traces the controller there)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--ignore-eos", action="store_true", help="every rollout runs to --max-tokens (a fixed batch)")
    p.add_argument("--baseline-controller", default=None, help="another version's adaptive.py, timed as `baseline`")
    args = p.parse_args()
    policy, head = main_job_models(args.threads, args.checkpoint)
    policy, head = policy.to(args.device), head.to(args.device)
    runs = engines(policy, head, args.baseline_controller)
    others = [name for name in runs if name != "plain"]
    steps: list = []
    watch(runs["adaptive"], steps)
    seconds, rounds = Counter(), []
    for r, this in alternating_rounds(runs, args.rounds, args.prompts, args.samples, args.max_tokens, args.ignore_eos):
        if r == 0:
            steps.clear()  # the untimed round: the controller's first exploration is in it
            continue
        seconds.update(this)
        rounds.append({name: this["plain"] / this[name] for name in others})
        print(f"round {r}: " + " ".join(f"{n} {t:.3f}s" for n, t in this.items()), flush=True)
    kinds = Counter(kind for *_, kind, _ in steps)
    kind_seconds = Counter()
    for *_, kind, t in steps:
        kind_seconds[kind] += t
    choices = Counter((octave(b), k) for b, k, _, _ in steps)
    result = {
        "benchmark": "adaptive_ab", "machine": machine(args.device), "target": TARGET, "drafter": DRAFTER,
        "checkpoint": args.checkpoint, "device": args.device,
        "rollout": f"{args.prompts} prompts x {args.samples} samples, T=1, max {args.max_tokens} tokens, "
                   + ("EOS ignored" if args.ignore_eos else "EOS stops"),
        "rounds": args.rounds, "seconds": dict(seconds),
        "baseline_controller": args.baseline_controller,
        "over_plain": {n: seconds["plain"] / seconds[n] for n in others},
        "per_round_over_plain": rounds,
        "adaptive_steps": {k: {"steps": kinds[k], "seconds": kind_seconds[k]} for k in kinds},
        "adaptive_choices_per_octave": {o: [choices[(o, k)] for k in range(4)]
                                        for o in sorted({o for o, _ in choices})},
    }
    print(json.dumps({k: result[k] for k in ("over_plain", "adaptive_steps", "adaptive_choices_per_octave")},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
