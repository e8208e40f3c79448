"""Run the tiny GRPO recipe unchanged, but also write every rollout's token ids to RUN_DIR/rollouts.jsonl.

    python research/lossless/record_rollouts.py [recipe key=value overrides ...]

`metrics.jsonl` holds only per-step aggregates (reward, loss, token counts), so the losslessness check of issue 4
("identical trajectories under greedy rollouts") needs the tokens themselves. This wrapper calls
`recipes/tiny_grpo_spec.py`'s own `main` (same config, same loop, same seeds) with `EmbeddedGenerator.generate`
and `Trainer.evaluate` observed, and appends one JSON line per generate call:

    {"call": 0, "kind": "train" | "eval", "step": 0, "seed": 0, "temperature": 1.0,
     "token_ids": [[...], ...], "logprobs": [[...], ...], "finish": ["stop", ...]}

Observation only: nothing the loop computes is changed (the wrapper reads the returned completions).
Compare two runs with `compare_runs.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROLLOUTS_FILE = "rollouts.jsonl"


def out_dir(argv: list[str]) -> Path:
    from megatron_spec.rl.overrides import apply_overrides
    from recipes.tiny_grpo_spec import tiny_grpo_spec

    return Path(apply_overrides(tiny_grpo_spec(), [a for a in argv if "=" in a and not a.startswith("-")]).run.out_dir)


def main(argv: list[str]) -> int:
    from megatron_spec.generators import embedded as gen_mod
    from megatron_spec.rl import loop
    from recipes import tiny_grpo_spec

    path = out_dir(argv) / ROLLOUTS_FILE
    if path.exists():
        print(f"{path} exists: use a fresh run.out_dir (a resumed run would append a second copy)", file=sys.stderr)
        return 2
    # Opened at the first rollout, not here: a run starting from step 0 first moves whatever its directory holds
    # to previous/ (`rl.checkpoint.set_aside_earlier_run`), an open file included.
    sink = None
    state = {"call": 0, "step": 0, "eval": False}

    original_generate = gen_mod.EmbeddedGenerator.generate
    original_step, original_evaluate = loop.Trainer.step, loop.Trainer.evaluate

    def generate(self, prompts, params):
        nonlocal sink
        outs = original_generate(self, prompts, params)
        if sink is None:
            sink = open(path, "w", encoding="utf-8")
        sink.write(json.dumps({
            "call": state["call"], "kind": "eval" if state["eval"] else "train", "step": state["step"],
            "seed": params.seed, "temperature": params.temperature,
            "token_ids": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
            "finish": [o.finish_reason for o in outs]}) + "\n")
        sink.flush()
        state["call"] += 1
        return outs

    def step(self, step):
        state["step"] = step
        return original_step(self, step)

    def evaluate(self):
        state["eval"] = True
        try:
            return original_evaluate(self)
        finally:
            state["eval"] = False

    gen_mod.EmbeddedGenerator.generate = generate
    loop.Trainer.step, loop.Trainer.evaluate = step, evaluate
    try:
        return tiny_grpo_spec.main(argv)
    finally:
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
