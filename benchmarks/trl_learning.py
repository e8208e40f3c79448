"""Does our GRPO loop learn? The same run checked against TRL's `GRPOTrainer`, which no one here wrote.

For each learning rate and seed, two runs from the same policy checkpoint:

- ours: `megatron_spec.rl.loop.Trainer` (the loop's own stages, `spec` off: plain decoding is lossless-equal and
  faster to run here), one `Trainer.step` per RL step;
- TRL: `GRPOTrainer` with the settings `megatron_spec.bench.trl_peer` maps from the same `RLConfig` (prompts in the
  same order, our reward on the completion ids, group size, prompts per step, max tokens, temperature, lr, clip,
  KL 0, grad clip, AdamW betas, token-mean loss), for the same number of optimizer steps.

Both are judged by our evaluator (`Trainer.evaluate`: greedy accuracy on the held-out eval prompts) at the start,
every `--eval-every` steps and at the end; TRL's model is copied into an evaluator `Trainer` (the parameter names
are the same). Beside the reward curves, what limits learning in the set-up: per step the share of GRPO groups
whose rewards are all 0 or all 1 (zero advantage: no gradient from them), the policy's mean token entropy on the
rollouts, the cosine between consecutive steps' (clipped) gradients (near 0: each update is mostly the noise of its
own rollouts, and AdamW's per-parameter normalisation makes a noise step as long as a signal step), and at start
and end pass@1 / pass@k of T=1 samples on the eval prompts and how far the weights moved.

    python benchmarks/trl_learning.py --lr 1e-5 1e-4 --steps 50 --seeds 0 --threads 1
    python benchmarks/trl_learning.py --config configs/other.yaml --policy checkpoints/other grpo.group_size=16

The config is the RLConfig defaults (the main job), then `--config`, then `key=value` overrides, then `--policy`,
`--lr`, `--steps`, seed and threads. Writes `--out` (default research/records/trl_learning.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings

import torch

from megatron_spec.bench.common import machine, print_table, write_json
from megatron_spec.bench.trl_peer import make_trainer, require_trl
from megatron_spec.engine import SamplingParams
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.loop import Trainer, make_batch
from megatron_spec.rl.overrides import apply_overrides, load_yaml, to_dict
from megatron_spec.speculative.sampling import processed_logprobs

warnings.filterwarnings("ignore", message="TRL currently supports vLLM")  # TRL's import notice; vLLM is unused

PASSK_SEED = 12345
"""Sampling seed of the pass@k draws: the same draws for every model evaluated."""


def config(args, lr: float, seed: int, out_dir: str) -> RLConfig:
    cfg = load_yaml(args.config) if args.config else RLConfig()
    cfg = apply_overrides(cfg, args.overrides)
    cfg.spec = None
    if args.policy:
        cfg.model.policy = args.policy
    cfg.model.drafter = None
    cfg.grpo = dataclasses.replace(cfg.grpo, lr=lr)
    cfg.run = dataclasses.replace(cfg.run, steps=args.steps, seed=seed, threads=args.threads, out_dir=out_dir,
                                  resume=False, report=False)
    return cfg


def group_stats(rewards: torch.Tensor) -> dict:
    """rewards [P, G] -> how many groups carry no advantage (all 0, all 1, or otherwise constant)."""
    lo, hi = rewards.min(dim=1).values, rewards.max(dim=1).values
    constant = lo == hi
    return {"groups": rewards.shape[0], "all_zero": int((constant & (hi <= 0)).sum()),
            "all_one": int((constant & (lo >= 1)).sum()), "zero_adv_share": float(constant.float().mean())}


def token_entropy(model, prompts: list[list[int]], outs, sampling: dict) -> float:
    """Mean entropy (nats) of the processed next-token distribution over every generated token of the batch, the
    quantity TRL logs as `entropy` (a token-mean over the batch)."""
    batch, _ = make_batch(prompts, outs)
    with torch.no_grad():
        lp = processed_logprobs(model(batch.input_ids)[:, :-1], **sampling)
    ent = -(lp.exp() * torch.where(torch.isfinite(lp), lp, 0.0)).sum(-1)
    mask = batch.mask[:, 1:]
    return float(ent[mask].mean())


class GradCosine:
    """Cosine between this optimizer step's gradient and the previous one's (None at the first)."""

    def __init__(self):
        self.prev: torch.Tensor | None = None

    def __call__(self, model) -> float | None:
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                       for p in model.parameters()])
        cos = None if self.prev is None else float(torch.nn.functional.cosine_similarity(g, self.prev, dim=0))
        self.prev = g
        return cos


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def weight_change(model, start: torch.Tensor) -> float:
    """||theta_end - theta_start|| / ||theta_start||."""
    return float((flat_params(model) - start).norm() / start.norm())


class RecordingTrainer(Trainer):
    """Our loop, unchanged, recording per step what `score` sees (the rewards per group, the rollouts' token entropy
    under the policy that sampled them) and, after `learn`, the cosine of its gradient with the previous step's."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.record: dict = {}
        self.grad_cos = GradCosine()

    def score(self, problems, outs):
        rewards = super().score(problems, outs)
        g = self.cfg.grpo
        prompts = [self.task.encode(p) for p in problems for _ in range(g.group_size)]
        self.record = {**group_stats(rewards.view(g.prompts_per_step, g.group_size)),
                       "entropy": token_entropy(self.policy.model, prompts, outs, self.sampling)}
        return rewards

    def learn(self, prompts, rollouts, rewards, timer, drafter_budget_s=None):
        out = super().learn(prompts, rollouts, rewards, timer, drafter_budget_s)
        self.record["grad_cos_prev"] = self.grad_cos(self.policy.model)
        return out


def pass_at_k(trainer: Trainer, k: int) -> dict:
    """pass@1 and pass@k of k samples per eval prompt at the run's sampling (T, top-k, top-p), fixed seed."""
    cfg = trainer.cfg
    trainer.refit()
    problems = trainer.eval_task.problems(0, cfg.run.eval_prompts)
    prompts = [trainer.eval_task.encode(p) for p in problems for _ in range(k)]
    outs = trainer.generator.generate(prompts, SamplingParams(max_tokens=cfg.grpo.max_tokens, seed=PASSK_SEED,
                                                              **trainer.sampling))
    r = torch.tensor([trainer.eval_task.reward(o.token_ids, problems[i // k]) for i, o in enumerate(outs)])
    r = r.view(len(problems), k)
    return {"k": k, "pass@1": float(r.mean()), f"pass@{k}": float((r.max(dim=1).values >= 1).float().mean()),
            **{f"eval_{key}": v for key, v in group_stats(r).items() if key != "groups"}}


def run_ours(cfg, args) -> dict:
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    trainer = RecordingTrainer(cfg)
    start = flat_params(trainer.policy.model)
    evals = {0: trainer.evaluate()}
    start_passk = pass_at_k(trainer, args.k) if args.k else None
    steps, t0 = [], time.perf_counter()
    for s in range(cfg.run.steps):
        m = trainer.step(s)
        steps.append({"step": s, "reward_mean": m["reward_mean"], "response_len_mean": m["response_len_mean"],
                      "clip_frac": m.get("clip_frac"), "grad_norm": m.get("grad_norm"), **trainer.record})
        if (s + 1) % args.eval_every == 0 or s == cfg.run.steps - 1:
            evals[s + 1] = trainer.evaluate()
    wall = time.perf_counter() - t0
    end_passk = pass_at_k(trainer, args.k) if args.k else None
    trainer.close()
    return summarize(steps, evals, start_passk, end_passk, wall, weight_change(trainer.policy.model, start))


def run_trl(cfg, args, evaluator: Trainer) -> dict:
    """TRL's run of `cfg`, evaluated by `evaluator` (our Trainer, into whose policy TRL's weights are copied)."""
    trl = require_trl()
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(cfg.run.threads)
    g = cfg.grpo
    groups: list[dict] = []

    def recording(fn):
        def reward(completions, completion_ids, index, **kw):
            out = fn(completions, completion_ids, index, **kw)
            by_prompt: dict[int, list[float]] = {}
            for i, r in zip(index, out):
                by_prompt.setdefault(i, []).append(r)
            groups.append(group_stats(torch.tensor(list(by_prompt.values()))))
            return out

        reward.__name__ = fn.__name__
        return reward

    def evaluate(model) -> float:
        evaluator.policy.model.load_state_dict(model.state_dict())
        return evaluator.evaluate()

    evals: dict[int, float] = {}
    grad_cos, cosines = GradCosine(), []

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, a, state, control, model=None, **kw):
            cosines.append(grad_cos(model))

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % args.eval_every == 0 or state.global_step == cfg.run.steps:
                evals[state.global_step] = evaluate(model)

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(cfg.run.seed)
        trainer = make_trainer(cfg, cfg.run.steps, out_dir, callbacks=[Record()], reward=recording)
        start = flat_params(trainer.model)
        evals[0] = evaluate(trainer.model)
        start_passk = pass_at_k(evaluator, args.k) if args.k else None
        trainer.train()
    wall = time.perf_counter() - t0
    end_passk = None
    if args.k:
        evaluator.policy.model.load_state_dict(trainer.model.state_dict())
        end_passk = pass_at_k(evaluator, args.k)
    logs = [h for h in trainer.state.log_history if "reward" in h and "completions/mean_length" in h]
    if not len(logs) == len(groups) == len(cosines) == cfg.run.steps:
        raise RuntimeError(f"TRL made {len(logs)} logged steps, {len(groups)} reward calls and {len(cosines)} "
                           f"optimizer steps, expected {cfg.run.steps} of each (one generation batch of "
                           f"{g.prompts_per_step} x {g.group_size} per optimizer step)")
    steps = [{"step": s, "reward_mean": h["reward"], "response_len_mean": h["completions/mean_length"],
              "clip_frac": h.get("clip_ratio/region_mean"), "grad_norm": h.get("grad_norm"), **gs,
              "entropy": h.get("entropy"), "grad_cos_prev": c,
              "trl_frac_reward_zero_std": h.get("frac_reward_zero_std")}
             for s, (h, gs, c) in enumerate(zip(logs, groups, cosines))]
    out = summarize(steps, evals, start_passk, end_passk, wall, weight_change(trainer.model, start))
    out["version"] = trl.__version__
    return out


def window_mean(steps: list[dict], key: str, part: slice) -> float | None:
    vals = [s[key] for s in steps[part] if s.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(steps, evals, start_passk, end_passk, wall, moved) -> dict:
    n = max(1, min(10, len(steps) // 5))  # first / last tenth of the run (10 steps of 50)
    return {"eval_greedy_accuracy": {str(k): v for k, v in sorted(evals.items())},
            "start_accuracy": evals[0], "end_accuracy": evals[max(evals)],
            "reward_first": window_mean(steps, "reward_mean", slice(0, n)),
            "reward_last": window_mean(steps, "reward_mean", slice(-n, None)),
            "zero_adv_share": window_mean(steps, "zero_adv_share", slice(None)),
            "entropy_first": window_mean(steps, "entropy", slice(0, n)),
            "entropy_last": window_mean(steps, "entropy", slice(-n, None)),
            "grad_cos_prev": window_mean(steps, "grad_cos_prev", slice(None)), "weight_change": moved,
            "window": n, "start_passk": start_passk, "end_passk": end_passk, "wall_s": wall, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the RLConfig (grpo.group_size=16, ...)")
    ap.add_argument("--config", help="YAML config laid over the RLConfig defaults (the main job's)")
    ap.add_argument("--policy", help="policy checkpoint (default: the config's)")
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-4])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=10, help="greedy eval every N steps (and at start and end)")
    ap.add_argument("--k", type=int, default=8, help="samples per eval prompt for pass@k at start and end (0: off)")
    ap.add_argument("--only", choices=("both", "ours", "trl"), default="both")
    ap.add_argument("--out", default="research/records/trl_learning.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lr:
            for seed in args.seeds:
                cfg = config(args, lr, seed, f"{tmp}/run")
                entry = {"lr": lr, "seed": seed}
                if args.only in ("both", "ours"):
                    print(f"trl_learning: ours lr={lr:g} seed={seed} ...", flush=True)
                    entry["ours"] = run_ours(cfg, args)
                if args.only in ("both", "trl"):
                    print(f"trl_learning: TRL lr={lr:g} seed={seed} ...", flush=True)
                    evaluator = Trainer(config(args, lr, seed, f"{tmp}/eval"))
                    entry["trl"] = run_trl(cfg, args, evaluator)
                runs.append(entry)
                write_json(args.out, payload(args, cfg, runs))  # a long sweep leaves what it has so far
    rows = [{"lr": f"{e['lr']:g}", "seed": e["seed"], "run": name, "acc_start": r["start_accuracy"],
             "acc_end": r["end_accuracy"], "reward_first": r["reward_first"], "reward_last": r["reward_last"],
             "zero_adv": r["zero_adv_share"], "grad_cos": r["grad_cos_prev"],
             "ent_first": r["entropy_first"], "ent_last": r["entropy_last"],
             f"pass@{args.k}_start": (r["start_passk"] or {}).get(f"pass@{args.k}"),
             f"pass@{args.k}_end": (r["end_passk"] or {}).get(f"pass@{args.k}"), "wall_s": r["wall_s"]}
            for e in runs for name, r in e.items() if name in ("ours", "trl")]
    print_table(rows, list(rows[0]))
    print(f"wrote {args.out}")
    return 0


def payload(args, cfg, runs) -> dict:
    settings = to_dict(cfg)
    settings["grpo"].pop("lr")
    settings["run"].pop("seed")
    return {"benchmark": "trl_learning", "machine": machine(), "command": " ".join(sys.argv), "steps": args.steps,
            "eval_every": args.eval_every, "passk_k": args.k, "passk_seed": PASSK_SEED, "config": settings,
            "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
