"""`megatron-spec bench step`: RL step time and stage breakdown, plain vs speculative rollouts, same seeds.

For each variant (plain; each drafter, online or frozen) it runs `--steps` GRPO steps of the tiny recipe and
averages the stage times over all but the first (warm-up). It prints the plain step's generation share, and beside
the gen stage's speedup the whole step's (`whole_step`: plain over speculative seconds of every stage, the online
drafter's training, `drafter_s`, counted in the train stage), and the ideal bound for a synchronous step,
1 / (R_gen / S_gen + 1 - R_gen), where R_gen is the plain run's generation share and S_gen the measured generation
speedup: a variant at ~100 % of its bound adds no hidden cost to the other stages. It also writes the plain and best speculative measurements in the simulator's schema (`--sim-out`, read by
`research/sim_cpu/measured.py`).

The peer (`--peer trl`, run by default when TRL is installed) is TRL's GRPOTrainer on the plain run's workload,
timed the same way; its step time and our plain and best speculative step's speedups over it are printed and
written to the JSON (see trl_peer.py for what is matched).

The trainer runs as configured by default: length-bucketed micro-batches, the behaviour-logprob recompute folded
into the train forward (so the `logprob` stage is ~0 s: it only assembles the batch), and each group's prompt
computed once per step. `--micro-batch-tokens 0 --no-fold-logprob --no-share-prompt` measures the trainer as it was
before all three (one padded batch, a separate recompute forward, every prompt once per rollout).
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

from ..drafters.registry import drafter_method, method_names

STAGES = ("data", "prepare", "gen", "logprob", "train")


def variants(args) -> list[tuple[str, object]]:
    from ..rl.config import RLConfig
    from ..drafters.config import SpecConfig
    from .common import drafter_checkpoint

    base = RLConfig()
    base.model.policy = args.target
    base.grpo.prompts_per_step, base.grpo.group_size, base.grpo.max_tokens = args.prompts, args.group, args.max_tokens
    base.run.threads, base.run.eval_every, base.run.seed = args.threads, 0, args.seed
    if args.micro_batch_tokens is not None:
        base.grpo.micro_batch_tokens = args.micro_batch_tokens
    base.grpo.fold_logprob = not args.no_fold_logprob
    base.grpo.share_prompt = not args.no_share_prompt
    out = []
    plain = copy.deepcopy(base)
    plain.spec, plain.model.drafter = None, None
    out.append(("plain", plain))
    for method in args.drafters:
        drafter_dir = drafter_checkpoint(args.target, method, args.draft_model)
        needs_weights = drafter_dir is not None
        if needs_weights and not drafter_dir.is_dir():
            print(f"  skip {method}: no drafter at {drafter_dir}")
            continue
        for online in ((True, False) if needs_weights else (False,)):
            cfg = copy.deepcopy(base)
            cfg.spec = SpecConfig(method, args.k, adaptive=args.adaptive)
            cfg.model.drafter = str(drafter_dir) if needs_weights else None
            cfg.drafter_train.online = online
            label = f"{method} k={args.k}" + ("" if not needs_weights else " online" if online else " frozen")
            out.append((label, cfg))
    return out


def run_variant(cfg, steps: int) -> dict:
    import torch

    from ..rl.loop import Trainer

    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    trainer = Trainer(cfg)
    records = [trainer.step(s) for s in range(steps)]
    kept = records[1:] if len(records) > 1 else records
    mean = {st: sum(r["stages"][st] for r in kept) / len(kept) for st in STAGES}
    acc = [r["acceptance_length"] for r in kept if r["acceptance_length"]]
    lengths = [r["response_len_mean"] for r in kept]
    return {"stages": mean, "step_time": sum(mean.values()),
            "drafter_s": sum(r.get("drafter_s") or 0.0 for r in kept) / len(kept),
            "tokens_per_s": sum(r["tokens_per_s"] for r in kept) / len(kept),
            "acceptance_length": sum(acc) / len(acc) if acc else None, "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": sum(r["response_len_max"] for r in kept) / len(kept),
            "reward_mean": sum(r["reward_mean"] for r in kept) / len(kept)}


def main(args: argparse.Namespace) -> int:
    from ..rl.task import PromptTask
    from .common import machine, print_table, set_threads, write_json
    from .trl_peer import print_peer, run_peer

    set_threads(args.threads)
    results, configs = {}, variants(args)
    for label, cfg in configs:
        print(f"bench step: {label} ...")
        results[label] = run_variant(cfg, args.steps)
    plain = results["plain"]
    r_gen = plain["stages"]["gen"] / plain["step_time"]
    rows = []
    for label, r in results.items():
        s_gen = plain["stages"]["gen"] / r["stages"]["gen"]
        bound = 1.0 / (r_gen / s_gen + 1.0 - r_gen)
        e2e = plain["step_time"] / r["step_time"]
        rows.append({"variant": label, "step_s": r["step_time"], **{st: r["stages"][st] for st in STAGES},
                     "gen_speedup": s_gen, "e2e_speedup": e2e, "whole_step": e2e, "ideal_bound": bound,
                     "of_bound": e2e / bound, "drafter_s": r["drafter_s"],
                     "acc_len": r["acceptance_length"], "reward": r["reward_mean"]})
    best = max((r for r in rows if r["variant"] != "plain"), key=lambda r: r["e2e_speedup"], default=None)
    peer = run_peer(args, dict(configs)["plain"], plain, best)
    print(f"bench step: {args.target}, {args.prompts}x{args.group} rollouts, max {args.max_tokens} tokens, on {machine()}")
    print(f"plain step: gen share {r_gen:.3f}; whole_step = plain / spec seconds of the whole step (every stage, the "
          f"online drafter's training, drafter_s, in train)")
    print_table(rows, ["variant", "step_s", *STAGES, "drafter_s", "gen_speedup", "whole_step", "ideal_bound",
                       "of_bound", "acc_len"])
    print_peer(peer)
    payload = {"benchmark": "step", "machine": machine(), "target": args.target, "steps": args.steps,
               "plain_gen_share": r_gen, "rows": rows,
               "peer": peer}
    print(f"wrote {write_json(args.out, payload)}")
    # The simulator's validation case (b): the plain run and the best speculative one, in its schema, with how the
    # trainer ran and the response lengths' log-normal fitted to the steps' mean and longest response (a step keeps
    # no per-rollout lengths; see research/sim_cpu/measured.py and LengthDist.fit).
    from ..sim.config import LengthDist

    task = PromptTask.build("tiny", args.target, 64, args.seed)
    prompt_len = sum(len(task.encode(p)) for p in task.problems(0, 64)) / 64
    for label, key in (("plain", "plain"), (best["variant"] if best else None, "spec")):
        if label is None:
            continue
        r, grpo = results[label], dict(configs)[label].grpo
        spec = None
        if label != "plain":
            method = label.split()[0]
            spec = dict(k=args.k, acceptance_length=r["acceptance_length"], drafter=method,
                        draft_model="tiny-draft" if drafter_method(method).standalone else "",
                        online=label.endswith("online"))
        lengths = LengthDist.fit(r["response_len_mean"], r["response_len_max"], args.prompts * args.group,
                                 args.max_tokens)
        write_json(Path(args.sim_out).with_name(Path(args.sim_out).stem + ("" if key == "plain" else "_spec") + ".json"), {
            "machine": machine(), "model": "tiny-qwen3", "threads": args.threads,
            "workload": {"prompts_per_step": args.prompts, "group_size": args.group, "prompt_len": round(prompt_len),
                         "response": {"mean": lengths.mean, "max_tokens": args.max_tokens, "sigma": lengths.sigma,
                                      "measured_mean": r["response_len_mean"],
                                      "measured_longest": r["response_len_max"]}},
            "trainer": {"micro_batch_tokens": grpo.micro_batch_tokens, "fold_logprob": grpo.fold_logprob,
                        "share_prompt": grpo.share_prompt},
            "stages": r["stages"], "spec": spec})
    return 0 if all(math.isfinite(r["step_s"]) for r in rows) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="checkpoints/tiny-qwen3")
    p.add_argument("--drafters", nargs="+", default=list(method_names()))
    p.add_argument("--draft-model", default="checkpoints/tiny-draft", help="checkpoint of the draft_model drafter")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--adaptive", action="store_true", help="let the adaptive controller pick k (up to --k)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="trainer micro-batch budget in padded tokens (default: grpo.micro_batch_tokens; 0: one padded "
                        "batch)")
    p.add_argument("--no-fold-logprob", action="store_true",
                   help="recompute the behaviour logprobs in their own forward (grpo.fold_logprob=false)")
    p.add_argument("--no-share-prompt", action="store_true",
                   help="run every rollout's prompt through the trainer's forwards (grpo.share_prompt=false)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/bench_step.json")
    p.add_argument("--sim-out", default="runs/bench/bench_step_cpu.json")
    p.add_argument("--peer", choices=["trl"], default=None,
                   help="peer trainer on the same workload (default: trl when installed, else a skip line)")
    p.add_argument("--no-peer", action="store_true", help="do not run the peer")
