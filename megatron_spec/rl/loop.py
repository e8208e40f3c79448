"""Synchronous GRPO with speculative rollouts on the embedded default.

    for step:  data -> prepare (refit + wake) -> gen (rollouts) -> logprob (recompute) -> train (policy + drafter)

With `grpo.fold_logprob` (the default) the recompute is folded into the train forward, exact with one update per
step, and the `logprob` stage only assembles the batch and the mismatch metric.

`train(cfg)` validates everything it will need before computing anything, resumes from the run directory's last
checkpoint when it holds one for the same config, and logs one metrics line per step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from ..engine import SamplingParams
from ..spec.stats import speculation_summary
from . import checkpoint
from .config import RLConfig
from .grpo import group_advantages
from .policy import Batch
from .refit import buckets

REFIT_BUCKET_BYTES = 16 << 20
"""Refit bucket size: large enough to amortise per-bucket overhead, small enough to bound the staging memory."""


class StageTimer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def check_inputs(cfg: RLConfig) -> None:
    """Every file the run needs exists, before any model is built."""
    policy = cfg.model.policy
    if policy != "smollm2-135m" and not (Path(policy) / "config.json").is_file():
        raise FileNotFoundError(f"policy checkpoint {policy} not found (no config.json); "
                                f"`megatron-spec pretrain --preset tiny-qwen3 --out {policy}` makes the tiny one")
    if cfg.spec and cfg.spec.method in ("mtp", "eagle3", "draft_model"):
        drafter = cfg.model.drafter or cfg.spec.model
        if not drafter or not Path(drafter).is_dir():
            raise FileNotFoundError(f"spec method {cfg.spec.method!r} needs a drafter checkpoint; {drafter!r} not found "
                                    f"(`megatron-spec train-drafter --method {cfg.spec.method} ...` makes one)")


def load_drafter_for(cfg: RLConfig, policy_model):
    from ..models import from_pretrained, load_drafter

    if not cfg.spec or cfg.spec.method not in ("mtp", "eagle3", "draft_model"):
        return None
    path = cfg.model.drafter or cfg.spec.model
    if cfg.spec.method == "draft_model":
        return from_pretrained(path)
    return load_drafter(path, policy_model.config)


def make_batch(prompts: list[list[int]], outs) -> tuple[Batch, torch.Tensor]:
    """Right-padded prompt+completion ids, completion mask, and the engine's behaviour logprobs aligned to [B, T-1]."""
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    behaviour = torch.zeros(len(seqs), T - 1)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        n = len(p) + len(o.token_ids)
        ids[i, :n] = torch.tensor(p + o.token_ids)
        mask[i, len(p) : n] = True
        behaviour[i, len(p) - 1 : n - 1] = torch.tensor(o.logprobs)
    return Batch(ids, mask), behaviour


def logprob_mismatch(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |trainer - engine| log-prob over the generated tokens: ~0 when both apply the same processing."""
    return float((trainer - engine).abs()[mask].max()) if mask.any() else 0.0


def spec_metrics(outs) -> dict:
    summary = speculation_summary(outs)
    return {"acceptance_length": summary["acceptance_length"], "accepted_per_pos": summary["per_position"] or None}


class Trainer:
    """Holds the run's pieces; `step()` is one RL step."""

    def __init__(self, cfg: RLConfig):
        from ..models import from_pretrained
        from .backends import build_generator, build_policy
        from .task import PromptTask

        self.cfg = cfg
        g = cfg.grpo
        self.sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        model = from_pretrained(cfg.model.policy)
        drafter = load_drafter_for(cfg, model)
        self.task = PromptTask.build(cfg.model.task, cfg.model.policy, cfg.run.dataset_size, cfg.run.seed)
        self.eval_task = PromptTask.build(cfg.model.task, cfg.model.policy, max(cfg.run.eval_prompts, 1), cfg.run.seed, "eval")
        self.policy = build_policy(cfg, model, drafter)
        self.generator = build_generator(cfg, model, drafter)

    def step(self, step: int) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        timer = StageTimer()
        with timer("data"):
            problems = self.task.problems(step * g.prompts_per_step, g.prompts_per_step)
            prompts = [self.task.encode(p) for p in problems for _ in range(g.group_size)]
        with timer("prepare"):
            self.generator.update_weights(buckets(self.policy.export_weights(), REFIT_BUCKET_BYTES))
            self.generator.wake()
        with timer("gen"):
            params = SamplingParams(max_tokens=g.max_tokens, seed=cfg.run.seed * 100_003 + step, **self.sampling)
            outs = self.generator.generate(prompts, params)
            self.generator.sleep()
        rewards = torch.tensor([self.task.reward(o.token_ids, problems[i // g.group_size]) for i, o in enumerate(outs)])
        with timer("logprob"):
            batch, behaviour = make_batch(prompts, outs)
            if not g.fold_logprob:  # folded: train_step takes them from its own forward and fills them in
                batch.old_logprobs = self.policy.logprobs(batch)
        with timer("train"):
            batch.advantages = group_advantages(rewards.view(g.prompts_per_step, g.group_size), g.normalize_std).flatten()
            train = self.policy.train_step(batch)
        with timer("logprob"):
            mismatch = logprob_mismatch(batch.old_logprobs, behaviour, batch.mask[:, 1:])
        gen_tokens = sum(len(o.token_ids) for o in outs)
        lengths = [len(o.token_ids) for o in outs]
        return {"step": step, "stages": timer.times, "step_time": sum(timer.times.values()), "gen_tokens": gen_tokens,
                "tokens_per_s": gen_tokens / timer.times["gen"], **spec_metrics(outs),
                "reward_mean": float(rewards.mean()), "accuracy": float((rewards >= 1).float().mean()),
                "eval_accuracy": None, "logprob_mismatch": mismatch, "response_len_mean": sum(lengths) / len(lengths),
                "response_len_max": max(lengths), "kl": train.pop("kl", None), "drafter_loss": train.pop("drafter_loss", None),
                **train}

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out prompts (outside the stage timings)."""
        self.generator.update_weights(buckets(self.policy.export_weights(), REFIT_BUCKET_BYTES))
        problems = self.eval_task.problems(0, self.cfg.run.eval_prompts)
        outs = self.generator.generate([self.eval_task.encode(p) for p in problems],
                                       SamplingParams(temperature=0, max_tokens=self.cfg.grpo.max_tokens))
        return sum(self.eval_task.reward(o.token_ids, p) for o, p in zip(outs, problems)) / len(problems)


def train(cfg: RLConfig) -> dict:
    """Run (or resume) the RL job described by `cfg`; returns a summary of the last step."""
    from .logging import StepLogger

    check_inputs(cfg)
    torch.set_num_threads(cfg.run.threads)
    run_dir = Path(cfg.run.out_dir)
    saved = checkpoint.load_latest(run_dir) if cfg.run.resume else None
    if saved is not None:
        checkpoint.check_same_config(saved["config"], cfg, run_dir)
    torch.manual_seed(cfg.run.seed)
    trainer = Trainer(cfg)
    start = 0
    if saved is not None:
        trainer.policy.load_state_dict(saved["state"])
        torch.set_rng_state(saved["rng"])
        start = saved["step"] + 1
        print(f"resumed from {run_dir}/checkpoints (step {saved['step']})")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    logger = StepLogger(run_dir, cfg.run.steps)
    nan_streak, metrics = 0, {}
    try:
        for step in logger.progress(range(start, cfg.run.steps)):
            metrics = trainer.step(step)
            last = step == cfg.run.steps - 1
            if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last):
                metrics["eval_accuracy"] = trainer.evaluate()
            logger.log(metrics)
            nan_streak = nan_streak + 1 if metrics["skipped"] or not math.isfinite(metrics["loss"]) else 0
            if nan_streak >= cfg.grpo.max_nan_steps:
                raise RuntimeError(f"{nan_streak} consecutive steps with a non-finite loss (last at step {step}); "
                                   f"stopping. The last good checkpoint is in {run_dir}/checkpoints")
            if (step + 1) % cfg.run.save_every == 0 or last:
                checkpoint.save(run_dir, step, trainer.policy.state_dict(), cfg)
    finally:
        logger.close()
    return metrics
