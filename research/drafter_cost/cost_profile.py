"""Where the online drafter's training time goes on the main job: per RL step, the policy's own train step and the
drafter's update split into its forwards (the chained drafts over the detached states), losses, backwards,
optimizer steps (clip included), the agreement measurement, and the data movement of replay (dealing and packing
minibatches, appending to the replay buffer).

Runs the main job's recipe in this process (`recipes/tiny_grpo_spec.py`'s config, the overrides given laid over
it) with wrappers that time each piece; step 0 (kernel warm-up) is left out of the means.

    python research/drafter_cost/cost_profile.py --steps 6 --out research/records/drafter_cost_profile.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def profile(overrides: list[str], steps: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_spec.drafters import trainer as trainer_mod
    from megatron_spec.rl.loop import Trainer
    from megatron_spec.rl.overrides import apply_overrides
    from recipes.tiny_grpo_spec import tiny_grpo_spec

    cfg = apply_overrides(tiny_grpo_spec(), [*overrides, "run.eval_every=0", "run.report=false"])
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    inside = {"drafter": False}

    @contextmanager
    def timed(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            times[name] += time.perf_counter() - t0
            counts[name] += 1

    def wrap(obj, attr: str, name: str, only_in_drafter: bool = False):
        orig = getattr(obj, attr)

        def wrapped(*a, **k):
            if only_in_drafter and not inside["drafter"]:
                return orig(*a, **k)
            with timed(name):
                return orig(*a, **k)

        setattr(obj, attr, wrapped)

    wrap(trainer_mod, "depth_pairs", "drafter_forward")
    wrap(trainer_mod, "pairs_loss", "drafter_loss")
    wrap(trainer_mod, "agreement", "agreement")
    wrap(trainer_mod, "minibatches", "replay_minibatches")
    wrap(torch.Tensor, "backward", "drafter_backward", only_in_drafter=True)
    wrap(torch.nn.utils, "clip_grad_norm_", "drafter_optimizer", only_in_drafter=True)
    step_fn = trainer_mod.DrafterTrainer.step

    def drafter_step(self, target, forwards, tokens, deadline=None):
        inside["drafter"] = True
        try:
            with timed("drafter_total"):
                return step_fn(self, target, forwards, tokens, deadline)
        finally:
            inside["drafter"] = False

    trainer_mod.DrafterTrainer.step = drafter_step
    trainer = Trainer(cfg)
    if trainer.policy.drafter_trainer is not None and trainer.policy.drafter_trainer.opt is not None:
        wrap(trainer.policy.drafter_trainer.opt, "step", "drafter_optimizer")
    rows = []
    for s in range(steps):
        times.clear()
        counts.clear()
        m = trainer.step(s)
        rows.append({"step": s, "stages": m["stages"], "pieces": dict(times), "calls": dict(counts),
                     "gen_tokens": m["gen_tokens"], "acceptance_length": m.get("acceptance_length")})
    kept = rows[1:] or rows
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    pieces = sorted({k for r in kept for k in r["pieces"]})
    summary = {"stages": {k: mean([r["stages"].get(k, 0.0) for r in kept]) for k in kept[0]["stages"]},
               "pieces": {k: mean([r["pieces"].get(k, 0.0) for r in kept]) for k in pieces},
               "calls_per_step": {k: mean([r["calls"].get(k, 0) for r in kept]) for k in pieces}}
    p = summary["pieces"]
    accounted = sum(p.get(k, 0.0) for k in ("drafter_forward", "drafter_loss", "agreement", "drafter_backward",
                                            "drafter_optimizer", "replay_minibatches"))
    p["drafter_other"] = p.get("drafter_total", 0.0) - accounted
    summary["policy_train"] = summary["stages"]["train"] - p.get("drafter_total", 0.0)
    summary["drafter_share_of_train"] = p.get("drafter_total", 0.0) / summary["stages"]["train"]
    return {"overrides": overrides, "steps": steps, "summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron_spec.bench.common import machine

    load = os.getloadavg()[0]
    result = {"label": args.label, "machine": machine(), "command": "python research/drafter_cost/cost_profile.py "
              + " ".join(argv if argv is not None else sys.argv[1:]), **profile(args.overrides, args.steps)}
    result["load_average"] = [load, os.getloadavg()[0]]  # before and after: the host is shared
    s = result["summary"]
    print(json.dumps({"label": args.label, **{k: s[k] for k in ("stages", "pieces", "calls_per_step",
                                                                  "policy_train", "drafter_share_of_train")}},
                     indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
