"""How fresh is a drafter at the end of an RL run? Its acceptance on the policy it drafts for, against a ceiling.

The main job's freshness claim divides a drafter's acceptance length over the last 10 steps by that over the
first 10. That ratio also moves when the text itself gets easier or harder to draft, so this measures the drafter
against what a head could do on the same policy. For the last checkpoint of each run given, on that checkpoint's
policy, the acceptance length (k = 3 on every step, T = 1, the RL task's training prompts) of:

- `run`: the run's own drafter (online: trained along with the policy; frozen: the shipped head);
- `refit`: the ceiling, the shipped head trained offline on this policy's own rollouts (`train-drafter`'s recipe:
  512 prompts, T = 1, 400 steps of 32 at lr 1e-3 from the shipped head);

and, as where every run starts, the shipped policy with the shipped head. `run / refit` is the share of the
reachable acceptance the drafter keeps.

    python benchmarks/drafter_ceiling.py runs/main_job_bench/online-s0 runs/main_job_bench/frozen-s0 \\
        --out research/records/main_job_drafter_ceiling.json

No timing: acceptance lengths are counts, the same on any machine up to float reduction order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_spec.bench.common import MAIN_JOB_DRAFTER, MAIN_JOB_POLICY

ROOT = Path(__file__).resolve().parents[1]
POLICY, HEAD = ROOT / MAIN_JOB_POLICY, ROOT / MAIN_JOB_DRAFTER
K, MAX_TOKENS = 3, 160  # the main job's draft length and rollout length


def acceptance(policy, head, prompts, seed: int) -> dict:
    """Acceptance length and per-position acceptance of `head` drafting k=K for `policy` on `prompts` at T=1."""
    from megatron_spec.engine import LLMEngine, SamplingParams
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.speculative.stats import speculation_summary

    engine = LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", K, adaptive=False), drafter=head)
    s = speculation_summary(engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)))
    return {"acceptance_length": s["acceptance_length"], "per_position": s["per_position"]}


def refit(policy, seed: int):
    """The shipped head trained offline on `policy`'s own rollouts (`megatron-spec train-drafter`'s defaults)."""
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.rl.train_drafter import capture_layers, rollouts, task_prompts, train

    head = load_drafter(HEAD, policy.config)
    prompts = task_prompts(str(POLICY), 512, seed)
    ids, mask, feats = rollouts(policy, prompts, MAX_TOKENS, 1.0, seed, capture_layers("mtp", policy, head))
    train(policy, head, "mtp", ids, mask, steps=400, batch_size=32, lr=1e-3, seed=seed, log_every=0, feats=feats)
    return head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories whose last checkpoint to measure")
    p.add_argument("--prompts", type=int, default=256, help="training prompts the acceptance is measured on")
    p.add_argument("--seed", type=int, default=7, help="seed of the prompts, the refit's rollouts and the sampling")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.rl.checkpoint import load_latest
    from megatron_spec.rl.train_drafter import task_prompts

    torch.set_num_threads(2)
    prompts = task_prompts(str(POLICY), args.prompts, args.seed)
    policy = from_pretrained(POLICY)
    start = acceptance(policy, load_drafter(HEAD, policy.config), prompts, args.seed)
    print(f"shipped policy, shipped head: {start['acceptance_length']:.3f}")
    rows = []
    for run in args.runs:
        saved = load_latest(Path(run))
        if saved is None:
            raise SystemExit(f"{run} has no checkpoint")
        policy = from_pretrained(POLICY)
        policy.load_state_dict(saved["state"]["model"])
        head = load_drafter(HEAD, policy.config)
        head.load_state_dict(saved["state"]["drafter"])
        own = acceptance(policy, head, prompts, args.seed)
        ceiling = acceptance(policy, refit(policy, args.seed), prompts, args.seed)
        online = saved["config"]["drafter_train.online"]
        settings = {k: saved["config"].get(f"drafter_train.{k}", 1) for k in ("updates", "replay", "minibatches")}
        row = {"run": run, "step": saved["step"], "online": online, "drafter_train": settings, "run_drafter": own,
               "refit": ceiling,
               "run_over_refit": own["acceptance_length"] / ceiling["acceptance_length"]}
        rows.append(row)
        print(f"{run} (step {saved['step']}, {'online' if online else 'frozen'}): run's head "
              f"{own['acceptance_length']:.3f}, refit {ceiling['acceptance_length']:.3f}, "
              f"ratio {row['run_over_refit']:.3f}", flush=True)
    if args.out:
        from megatron_spec.bench.common import machine

        record = {"machine": machine(), "k": K, "max_tokens": MAX_TOKENS, "prompts": args.prompts, "seed": args.seed,
                  "policy": str(POLICY.relative_to(ROOT)), "head": str(HEAD.relative_to(ROOT)),
                  "shipped": start, "rows": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
