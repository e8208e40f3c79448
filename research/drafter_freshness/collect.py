"""Collects the freshness runs (`README.md`) into one record: per variant its overrides, optimizer steps a step,
acceptance length per step, first / last 10 steps' means and their ratio, the mean pre-update drafter loss, and
the drafter's and the policy's train seconds per step (shared host: compare them within a run only).

    python research/drafter_freshness/collect.py RUNS_DIR --out research/records/drafter_freshness_minibatches.json
    python research/drafter_freshness/collect.py RUNS_DIR --set ema --out research/records/drafter_freshness_ema.json
    python research/drafter_freshness/collect.py RUNS_DIR --set extra --out research/records/drafter_freshness_extra.json

`--set ema` and `--set extra` (the drafter also learning from the groups the policy leaves out): runs made after the
engine began drawing each position's token with its own uniform (so a forced-k run writes its plain pair's
rollouts, and these runs differ from the first set's in trajectory: compare within a set).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_spec.bench.common import machine, write_json

COMMAND = ("python recipes/tiny_grpo_spec.py run.seed=S run.threads=1 spec.adaptive=false run.steps=50 "
           "run.eval_every=0 run.report=false run.resume=false run.out_dir=RUNS_DIR/NAME [overrides]")
VARIANTS = {  # name: (seed, overrides, optimizer steps an RL step once the replay is full)
    "base50": (0, ["drafter_train.minibatches=8"], 32),
    "frozen50": (0, ["drafter_train.online=false"], 0),
    "mb1": (0, ["drafter_train.minibatches=1"], 4),
    "mb2": (0, ["drafter_train.minibatches=2"], 8),
    "mb4": (0, ["drafter_train.minibatches=4"], 16),
    "warm100": (0, ["drafter_train.minibatches=8", "(lr warm-up over 100 optimizer steps, code not kept)"], 32),
    "lr1e-4": (0, ["drafter_train.minibatches=8", "drafter_train.lr=1e-4"], 32),
    "mb2_lr1e-4": (0, ["drafter_train.minibatches=2", "drafter_train.lr=1e-4"], 8),
    "mb1_lr6e-4": (0, ["drafter_train.minibatches=1", "drafter_train.lr=6e-4"], 4),
    "mb1_lr1e-3": (0, ["drafter_train.minibatches=1", "drafter_train.lr=1e-3"], 4),
    "mb2_lr6e-4": (0, ["drafter_train.minibatches=2", "drafter_train.lr=6e-4"], 8),
    "mb2_lr1e-3": (0, ["drafter_train.minibatches=2", "drafter_train.lr=1e-3"], 8),
    "mb1_r8": (0, ["drafter_train.minibatches=1", "drafter_train.replay=8"], 8),
    "r2_mb2": (0, ["drafter_train.minibatches=2", "drafter_train.replay=2"], 4),
    "r8_mb2": (0, ["drafter_train.minibatches=2", "drafter_train.replay=8"], 16),
    "new_online": (0, [], 8),
    "new_frozen": (0, ["drafter_train.online=false"], 0),
    "s1_base": (1, ["drafter_train.minibatches=8"], 32),
    "s1_new": (1, [], 8),
    "s1_frozen": (1, ["drafter_train.online=false"], 0),
    "tg8_mb4": (0, ["grpo.train_groups=8", "drafter_train.minibatches=4"], 16),
    "tg8_frozen": (0, ["grpo.train_groups=8", "drafter_train.online=false"], 0),
}
EMA_VARIANTS = {  # the recipe's 2 minibatches x replay 4 unless named
    "base": (0, ["drafter_train.lr=3e-4 (the recipe's before)"], 8),
    "frozen": (0, ["drafter_train.online=false"], 0),
    "ema9": (0, ["drafter_train.ema=0.9", "drafter_train.lr=3e-4"], 8),
    "ema9lr1e3": (0, ["drafter_train.ema=0.9", "drafter_train.lr=1e-3"], 8),
    "ema97lr1e3": (0, ["drafter_train.ema=0.97", "drafter_train.lr=1e-3"], 8),
    "ema97lr2e3": (0, ["drafter_train.ema=0.97", "drafter_train.lr=2e-3"], 8),
    "ema99lr3e3": (0, ["drafter_train.ema=0.99", "drafter_train.lr=3e-3"], 8),
    "ema97lr1e3r8": (0, ["drafter_train.ema=0.97", "drafter_train.lr=1e-3", "drafter_train.replay=8"], 16),
    "s1base": (1, ["drafter_train.lr=3e-4 (the recipe's before)"], 8),
    "s1ema97lr1e3": (1, ["drafter_train.ema=0.97", "drafter_train.lr=1e-3"], 8),
}
EXTRA_VARIANTS = {  # ema 0.97, lr 1e-3 (the recipe then) and replay 4 x 2 minibatches unless named
    "xg4": (0, ["drafter_train.extra_groups=4"], 8),
    "xg8": (0, ["drafter_train.extra_groups=8"], 8),
    "xg4r2": (0, ["drafter_train.extra_groups=4", "drafter_train.replay=2"], 4),
    "xg8r1": (0, ["drafter_train.extra_groups=8", "drafter_train.replay=1"], 2),
    "xg4r2m4": (0, ["drafter_train.extra_groups=4", "drafter_train.replay=2", "drafter_train.minibatches=4"], 8),
    "xg12r1m8": (0, ["drafter_train.extra_groups=12", "drafter_train.replay=1", "drafter_train.minibatches=8"], 8),
    "xg20r1m8": (0, ["drafter_train.extra_groups=20", "drafter_train.replay=1", "drafter_train.minibatches=8"], 8),
    "s1xg8": (1, ["drafter_train.extra_groups=8"], 8),
    "s1xg8r1m8": (1, ["drafter_train.extra_groups=8", "drafter_train.replay=1", "drafter_train.minibatches=8"], 8),
    "s1xg12r1m8": (1, ["drafter_train.extra_groups=12", "drafter_train.replay=1", "drafter_train.minibatches=8"], 8),
    "s1xg20r1m8": (1, ["drafter_train.extra_groups=20", "drafter_train.replay=1", "drafter_train.minibatches=8"], 8),
}


def summary(run: Path) -> dict:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tau = [m["acceptance_length"] for m in steps]
    drafter = [m.get("drafter_s") or 0.0 for m in steps]
    policy = [m["stages"]["train"] - d for m, d in zip(steps, drafter)]
    losses = [m["drafter_loss"] for m in steps if m.get("drafter_loss") is not None]
    first, last = statistics.mean(tau[:10]), statistics.mean(tau[-10:])
    return {"steps": len(tau), "tau_curve": tau, "tau_first10": first, "tau_last10": last, "ratio": last / first,
            "tau_mean": statistics.mean(tau), "drafter_loss_mean": statistics.mean(losses) if losses else None,
            "drafter_s": statistics.mean(drafter), "policy_train_s": statistics.mean(policy),
            "drafter_over_policy_train": sum(drafter) / sum(policy)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path)
    p.add_argument("--out", default="research/records/drafter_freshness_minibatches.json")
    p.add_argument("--set", choices=["minibatches", "ema", "extra"], default="minibatches")
    args = p.parse_args(argv)
    runs = {}
    sets = {"minibatches": VARIANTS, "ema": EMA_VARIANTS, "extra": EXTRA_VARIANTS}
    for name, (seed, overrides, opt_steps) in sets[args.set].items():
        if (args.runs / name / "metrics.jsonl").is_file():
            runs[name] = {"seed": seed, "overrides": overrides, "optimizer_steps": opt_steps,
                          **summary(args.runs / name)}
            r = runs[name]
            print(f"{name:12s} seed {seed} {opt_steps:2d} steps  first {r['tau_first10']:.3f} last "
                  f"{r['tau_last10']:.3f} ratio {r['ratio']:.3f} mean {r['tau_mean']:.3f} drafter "
                  f"{r['drafter_s']:.2f} s ({r['drafter_over_policy_train']:.1f}x policy)")
    record = {"command": COMMAND, "machine": machine(), "window": 10,
              "note": "2-core host shared with other jobs: seconds comparable within a run only", "runs": runs}
    print(f"wrote {write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
