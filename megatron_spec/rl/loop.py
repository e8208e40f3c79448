"""Synchronous GRPO with speculative rollouts on the embedded default.

    for step:  data -> prepare (refit + wake) -> gen (rollouts) -> logprob (recompute) -> train (policy + drafter)

With `grpo.fold_logprob` (the default) the recompute is folded into the train forward, exact with one update per
step, and the `logprob` stage only assembles the batch and the mismatch metric.

`train(cfg)` validates everything it will need before computing anything, resumes from the run directory's last
checkpoint when it holds one for the same config, and logs one metrics line per step. `Trainer.step` is written as
stage methods (`draw`, `refit`, `rollouts`, `score`, `learn`, `metrics`) so that the Ray driver
(`megatron_spec.placement.driver`, `backend.placement` colocated / disaggregated) runs this very loop with the
trainer and the generators in worker groups: it overrides where the pieces live (`build_backends`), how weights
reach the engines (`refit`) and how rollouts are produced (`rollouts`, which may run ahead with `async_lag`), and
`run(cfg, make_trainer)` is the one outer loop (resume, logging, NaN stop, checkpoints) for both.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import yaml

from ..models.routing import ROUTING_DTYPE
from ..speculative.adaptive import WholeStepGate
from ..drafters.registry import drafter_method, needs_weights
from ..interfaces import Batch, Generator, Policy, Rollouts, SamplingParams
from ..speculative.stats import speculation_summary
from . import checkpoint
from .. import memory
from .config import RLConfig
from .grpo import correction_stats, group_advantages, overlong_penalty, rejection_mask, uniform_groups
from ..refit import buckets
from .replay import Replay
from .stop import SaveClock, StopRequest, save_due

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


def config_problems(cfg: RLConfig) -> list[str]:
    """Combinations of settings the run cannot take, read from the config alone (no file, no device), so a launcher
    asks them on the submitting machine too (`launchers.checks.check_launch`)."""
    problems = []
    if cfg.run.device != "cpu" and cfg.backend.placement != "inline":
        problems.append(f"run.device={cfg.run.device} places the in-process trainer and generator; the "
                        f"{cfg.backend.placement} placement's worker groups place their own (leave run.device=cpu)")
    d = cfg.drafter_train
    beside = cfg.spec is not None and drafter_method(cfg.spec.method).megatron_beside
    if cfg.backend.trainer == "megatron" and (max(d.updates, d.replay, d.minibatches) > 1 or d.ema):
        problems.append("the Megatron trainer updates its drafter once a step on the step's batch (an MTP head "
                        "jointly with the policy, backend.megatron.mtp_*); drafter_train.updates, replay and "
                        "minibatches > 1 and ema > 0 are the embedded trainer's: set them to 1 (ema to 0)")
    if cfg.backend.trainer == "megatron" and d.drafts > 1 and not beside:
        problems.append("the Megatron trainer trains an MTP head's first draft only (jointly with the policy); "
                        "drafter_train.drafts > 1 unrolls an EAGLE-3 head (spec.method=eagle3): set it to 1")
    if d.extra_groups and cfg.backend.trainer != "embedded":
        problems.append("drafter_train.extra_groups feeds rows the policy does not train to the embedded trainer's "
                        "drafter: use it with backend.trainer=embedded (or set it to 0)")
    age = cfg.grpo.max_trajectory_age
    if age is not None and age < cfg.backend.async_lag:
        problems.append(f"grpo.max_trajectory_age={age} is below backend.async_lag={cfg.backend.async_lag}, the age "
                        f"every step's rollouts reach, so every step would drop all its groups: set "
                        f"grpo.max_trajectory_age >= {cfg.backend.async_lag} (or null: no bound)")
    if d.extra_groups and not (cfg.grpo.drop_uniform_groups or cfg.grpo.train_groups):
        problems.append("drafter_train.extra_groups takes the groups the policy leaves out of its update, and with "
                        "neither grpo.drop_uniform_groups nor grpo.train_groups it leaves none out")
    m = cfg.backend.megatron
    if cfg.grpo.routing_replay and cfg.backend.trainer == "megatron":
        from ..layout import routing_replay_problems

        problems += routing_replay_problems(m.recompute, m.sequence_parallel, m.virtual_pipeline)
    if cfg.backend.generator == "vllm" and cfg.spec is not None:
        from ..drafters.registry import vllm_problem

        if problem := vllm_problem(cfg.spec.method):
            problems.append(problem)
    if cfg.backend.trainer == "megatron" and beside:
        from ..layout import online_eagle3_problems

        problems += online_eagle3_problems(m.mtp_num_layers, m.virtual_pipeline)
    return problems


def check_inputs(cfg: RLConfig) -> None:
    """Every file and the device the run needs exist, before any model is built or anything is written."""
    cfg.run.torch_device()
    if problems := config_problems(cfg):
        raise ValueError("; ".join(problems))
    policy = cfg.model.policy
    if policy != "smollm2-135m" and not (Path(policy) / "config.json").is_file():
        raise FileNotFoundError(f"policy checkpoint {policy} not found (no config.json); "
                                f"`megatron-spec pretrain --preset tiny-qwen3 --out {policy}` makes the tiny one")
    if cfg.backend.trainer == "megatron":  # Megatron-Core's sequence-parallel rules, met at its first train step
        from ..layout import sequence_parallel_problems
        from ..models.hf_io import read_config

        m = cfg.backend.megatron
        model = read_config(policy) if policy != "smollm2-135m" else None
        # inline, the trainer runs in this process (on CUDA when there is one); under Ray each rank checks its own
        on_gpus = torch.cuda.is_available() or cfg.backend.placement != "inline"
        problems = sequence_parallel_problems(model, m.layout(), m.sequence_parallel, on_gpus=on_gpus)
        if problems:
            raise ValueError("; ".join(problems))
    if cfg.grpo.routing_replay:
        from ..models.hf_io import read_config
        from ..models.presets import preset

        if not (preset(policy) if policy == "smollm2-135m" else read_config(policy)).is_moe:
            raise ValueError(f"grpo.routing_replay replays the experts of an MoE policy; {policy} is dense: "
                             f"set grpo.routing_replay=false")
    from .task import task_difficulty

    try:
        task_difficulty(cfg.model.task, policy, cfg.model.terms_weights)
    except ValueError as err:
        raise ValueError(f"{err} (model.task={cfg.model.task!r}, model.terms_weights, policy {policy})") from None
    from .logging import check_loggers

    check_loggers(cfg.run.loggers)  # a tracker that is not installed fails before any model is built
    if cfg.data.path is not None:
        from ..tasks.dataset import is_local
        from ..tasks.scoring import resolve

        if is_local(cfg.data.path) and not Path(cfg.data.path).expanduser().exists():
            raise FileNotFoundError(f"data.path {cfg.data.path} not found")
        resolve(cfg.data.reward)  # a reward function that cannot be imported fails before any model is built
    if cfg.spec and needs_weights(cfg.spec.method):
        drafter = cfg.model.drafter or cfg.spec.model
        if not drafter or not Path(drafter).is_dir():
            raise FileNotFoundError(f"spec method {cfg.spec.method!r} needs a drafter checkpoint; {drafter!r} not found "
                                    f"(`megatron-spec train-drafter --method {cfg.spec.method} ...` makes one)")


def load_drafter_for(cfg: RLConfig, policy_model):
    """The run's drafter module on the policy's device (its registry entry loads it), or None for a method without
    weights or a plain run."""
    if not cfg.spec or not needs_weights(cfg.spec.method):
        return None
    return drafter_method(cfg.spec.method).load(cfg.model.drafter or cfg.spec.model, policy_model,
                                                policy_model.device)


def make_batch(prompts: list[list[int]], outs) -> tuple[Batch, torch.Tensor]:
    """Right-padded prompt+completion ids, completion mask, and the engine's behaviour logprobs aligned to [B, T-1],
    on the host: a batch crosses the Policy interface there (to a Ray actor, a Megatron rank), and each trainer
    moves it to its own device once."""
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
    return Batch(ids, mask, routing=batch_routing(outs, T)), behaviour


def batch_routing(outs, T: int) -> torch.Tensor | None:
    """[B, T, MoE layers, top_k] the rollouts' recorded routing, right-padded with -1 (route freely: padding and
    each row's last token, which no rollout forward read); None unless every rollout carries its routing."""
    if not outs or any(getattr(o, "routing", None) is None for o in outs):
        return None
    routing = torch.full((len(outs), T, *outs[0].routing.shape[1:]), -1, dtype=ROUTING_DTYPE)
    for i, o in enumerate(outs):
        routing[i, : len(o.routing)] = torch.from_numpy(o.routing)
    return routing


def fresh_groups(ages: list[int], group_size: int, max_age: int | None) -> torch.Tensor | None:
    """bool [P]: the GRPO groups none of whose rollouts (`ages` [N], prompt-major: policy versions between the
    weights that generated each and the weights being trained) is older than `max_age`; None where there is no
    bound. A group is kept or dropped whole: its advantages compare its rollouts with each other."""
    if max_age is None:
        return None
    return (torch.tensor(ages).view(-1, group_size) <= max_age).all(dim=1)


def shaped_rewards(rewards: torch.Tensor, lengths: list[int], g) -> torch.Tensor:
    """The rewards [N] (float64) with DAPO's overlong shaping of the GRPO section `g` added."""
    return rewards.double() + overlong_penalty(torch.tensor(lengths), g.max_tokens, g.overlong_buffer,
                                               g.overlong_penalty)


def waiting_groups(rewards: torch.Tensor, lengths: list[int], g, fresh: torch.Tensor,
                   keep: list[bool] | None) -> list[int]:
    """The groups (indices) a step leaves out of its update that a later step may still train: young enough
    (`fresh`), not trained now (`keep`, `step_advantages`'), and with a signal (rewards not uniform once shaped)."""
    uniform = uniform_groups(shaped_rewards(rewards, lengths, g).view(-1, g.group_size))
    kept = torch.ones_like(fresh) if keep is None else torch.tensor(keep[:: g.group_size])
    return (fresh & ~kept & ~uniform).nonzero().flatten().tolist()


def step_advantages(rewards: torch.Tensor, lengths: list[int], g,
                    fresh: torch.Tensor | None = None) -> tuple[torch.Tensor, list[bool] | None, dict]:
    """The advantages [N] of a step's rollouts (rewards [N], prompt-major groups of `g.group_size`) under the GRPO
    section's options: DAPO's overlong shaping of the rewards, then the group baseline and std. With `fresh` (bool
    [P], `fresh_groups`), `drop_uniform_groups` or `train_groups`, also which rows to keep (None: all) and the
    advantages of the kept rows only: the stale groups go first, dynamic sampling chooses among the rest; and the
    counts to log (uniform groups, groups dropped by dynamic sampling and as stale, mean shaping)."""
    shaped = shaped_rewards(rewards, lengths, g)
    groups = shaped.view(-1, g.group_size)
    uniform = uniform_groups(groups)
    info = {"uniform_groups": int(uniform.sum())}
    if g.overlong_buffer:
        info["overlong_penalty_mean"] = float((shaped - rewards.double()).mean())
    advantages = group_advantages(groups, g.baseline, g.std).float()
    keep = None
    candidates = torch.ones_like(uniform) if fresh is None else fresh
    kept = candidates
    if fresh is not None:
        info["groups_dropped_stale"] = int((~fresh).sum())
    if g.drop_uniform_groups or g.train_groups:
        signal = candidates & ~uniform
        kept = signal if signal.any() else candidates
        if g.train_groups:  # the first train_groups of them, in draw order
            kept = kept & (kept.cumsum(0) <= g.train_groups)
        info["groups_dropped"] = int((candidates & ~kept).sum())
    if not kept.all():
        keep = kept.repeat_interleave(g.group_size).tolist()
        advantages = advantages[kept]
    return advantages.flatten(), keep, info


def leave_out_rows(mask: torch.Tensor, advantages: torch.Tensor, keep: list[bool]):
    """The batch's mask with the rows not kept emptied, and the kept rows' advantages spread over all rows (0 for
    the others): the loss (`grpo.LossNorm` counts only rows with a generated token) and its gradient are then those
    of the batch without those rows, for a trainer that cannot change its row count."""
    kept = torch.tensor(keep, device=mask.device)
    full = torch.zeros(len(keep), dtype=advantages.dtype, device=advantages.device)
    full[kept.to(advantages.device)] = advantages
    return mask & kept[:, None], full


def logprob_mismatch(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |trainer - engine| log-prob over the generated tokens: ~0 when both apply the same processing."""
    return float((trainer - engine).abs()[mask].max()) if mask.any() else 0.0


def spec_metrics(outs) -> dict:
    summary = speculation_summary(outs)
    return {"acceptance_length": summary["acceptance_length"], "accepted_per_pos": summary["per_position"] or None}


class Trainer:
    """Holds the run's pieces; `step()` is one RL step, its stages are the methods below it."""

    replay: Replay | None = None
    """Groups left out of a step that a later one may train (`grpo.max_trajectory_age` set), else None."""

    def __init__(self, cfg: RLConfig):
        from .task import build_tasks

        self.cfg = cfg
        g = cfg.grpo
        self.sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        self.task, self.eval_task = build_tasks(cfg)
        self.policy, self.generator = self.build_backends()
        self.gate = WholeStepGate() if self.gated() else None
        # finished groups a step leaves out wait for a later one, under a staleness bound only
        self.replay = Replay() if cfg.grpo.max_trajectory_age is not None else None

    def build_backends(self) -> tuple[Policy, Generator]:
        """The trainer and the generator, in this process."""
        from ..models import from_pretrained
        from .backends import build_generator, build_policy

        if self.cfg.backend.trainer == "megatron":
            # No full policy in this process: every Megatron rank reads its own shards from the checkpoint files,
            # and the generator loads its copy in processes of its own.
            return build_policy(self.cfg, None, None), build_generator(self.cfg, None, None)
        model = from_pretrained(self.cfg.model.policy, device=self.cfg.run.torch_device())
        drafter = load_drafter_for(self.cfg, model)
        return build_policy(self.cfg, model, drafter), build_generator(self.cfg, model, drafter)

    def step(self, step: int) -> dict:
        timer = StageTimer()
        with timer("data"):
            problems, prompts = self.draw(step)
        with timer("prepare"):
            self.refit()
        speculate = self.step_mode(step)
        with self.speculation(speculate):
            with timer("gen"):
                rollouts = self.rollouts(step, prompts)
            rewards = self.score(problems, rollouts.outs)
            tokens = sum(len(o.token_ids) for o in rollouts.outs)
            budget = self.gate.drafter_budget(timer.times["gen"], tokens) if speculate and self.serial else None
            with self.speculation(False if budget == 0 else None, engine=False):
                replayed = min(len(self.replay), len(prompts) // self.cfg.grpo.group_size) if self.replay else 0
                train, mismatch = self.learn(*self.with_replay(prompts, rollouts, rewards), timer, budget)
                if self.replay is not None:
                    train.update(groups_replayed=replayed, groups_waiting=len(self.replay))
        gate = {}
        if self.gate:
            drafter_s = train.get("drafter_s", 0.0)
            gen_s, beside_s = self.generation_cost(timer, rollouts, drafter_s)
            self.gate.record(speculate, gen_s, drafter_s, tokens, beside_s)
            gate = {"speculate": speculate, "drafter_trained": "drafter_s" in train, **self.gate.state()}
        return {**self.metrics(step, timer, rollouts.outs, rewards, mismatch, train), **rollouts.metrics,
                **self.task.reward_stats, **gate}

    serial = True
    """Whether a step's generation runs between its other stages, not beside them (an async lag runs it ahead)."""

    def step_mode(self, step: int) -> bool | None:
        """The mode the step's rollouts are generated and its drafter trained in: the gate's decision (None: not
        gated, as configured)."""
        return self.gate.speculate() if self.gate else None

    def generation_cost(self, timer: StageTimer, rollouts: Rollouts, drafter_s: float) -> tuple[float, float | None]:
        """What the gate prices a step by (`WholeStepGate.record`): its generation's seconds, and the seconds of
        the work beside it (None here: the gen stage runs between the others, so it is the generation)."""
        return timer.times["gen"], None

    def gated(self) -> bool:
        """Whether the whole-step gate (`speculative.adaptive.WholeStepGate`) decides each step's mode: an adaptive
        spec with a drafter that trains online (`drafter_train.gate`), on a generator and a trainer that can both
        run a plain step (`supports_step_gate`: the embedded trainer with our engine or vLLM, in one process or in Ray
        actors)."""
        spec, d = self.cfg.spec, self.cfg.drafter_train
        return bool(spec and spec.adaptive and d.gate and d.online and self.generator.supports_step_gate
                    and self.policy.supports_step_gate and self.policy.trains_drafter_online)

    @contextmanager
    def speculation(self, on: bool | None, engine: bool = True):
        """The step's mode: None or True as configured; False a plain step, as `spec=null` runs it (the generator
        without drafts, the trainer without the drafter's training or agreement). `engine` False leaves the
        generator as it is (the trainer's part only)."""
        if on is None or on:
            yield
            return
        with ExitStack() as stack:
            if engine:
                stack.enter_context(self.generator.speculation(False))
            stack.enter_context(self.policy.speculation(False))
            yield

    def draw(self, step: int) -> tuple[list, list[list[int]]]:
        """This step's problems and prompts, each prompt repeated `group_size` times (its GRPO group)."""
        g = self.cfg.grpo
        problems = self.task.problems(step * g.prompts_per_step, g.prompts_per_step)
        return problems, [self.task.encode(p) for p in problems for _ in range(g.group_size)]

    def sampling_params(self, step: int) -> SamplingParams:
        """The rollouts' sampling of `step` (seeded by the run's seed and the step, so a re-run draws the same)."""
        return SamplingParams(max_tokens=self.cfg.grpo.max_tokens, seed=self.cfg.run.seed * 100_003 + step,
                              **self.sampling)

    def refit(self) -> None:
        """The trainer's weights (policy and drafter) into the generator, which wakes for the rollouts."""
        self.generator.update_weights(buckets(self.policy.export_weights(), REFIT_BUCKET_BYTES))
        self.generator.wake()

    def rollouts(self, step: int, prompts: list[list[int]]) -> Rollouts:
        outs = self.generator.generate(prompts, self.sampling_params(step))
        self.generator.sleep()
        return Rollouts(outs)

    def loop_state(self) -> dict:
        """What a checkpoint keeps of the loop beside the policy: the gate's state and the waiting groups."""
        return {"gate": self.gate.state_dict() if self.gate is not None else None,
                "replay": self.replay.state_dict() if self.replay is not None else None}

    def load_loop_state(self, saved: dict) -> None:
        """Take back `loop_state` from a checkpoint's payload (one saved before the replay existed has none)."""
        if self.gate is not None and saved.get("gate"):
            self.gate.load_state_dict(saved["gate"])
        if self.replay is not None and saved.get("replay"):
            self.replay.load_state_dict(saved["replay"])

    def with_replay(self, prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor):
        """The step's prompts, rollouts and rewards, behind the groups waiting in the replay (`rl/replay.py`)."""
        if self.replay is None:
            return prompts, rollouts, rewards
        return self.replay.offer(prompts, rollouts, rewards, self.cfg.grpo.group_size)

    def score(self, problems: list, outs) -> torch.Tensor:
        g = self.cfg.grpo
        return torch.tensor(self.task.rewards([o.token_ids for o in outs],
                                              [problems[i // g.group_size] for i in range(len(outs))]))

    def learn(self, prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor, timer: StageTimer,
              drafter_budget_s: float | None = None) -> tuple[dict, float | None]:
        """The logprob and train stages: one policy (and drafter) update on the rollouts, the drafter's cut short
        after `drafter_budget_s` (the gate's budget; in-process trainer only). Rollouts of an older policy
        version carry their behaviour log-probs into the loss's importance correction; their engine-vs-trainer
        mismatch is then the policy's drift, not a processing error, and is not reported (None). Groups older than
        `grpo.max_trajectory_age` leave the update as dynamic sampling's do, and with a rejection band the tokens
        or sequences whose ratio leaves it leave the batch's mask (so the loss's means count what is left)."""
        g, rc = self.cfg.grpo, self.cfg.grpo.rollout_correction
        ages = rollouts.row_ages
        fresh = fresh_groups(ages, g.group_size, g.max_trajectory_age)
        lengths = [len(o.token_ids) for o in rollouts.outs]
        advantages, keep, shaping = step_advantages(rewards, lengths, g, fresh)
        if self.replay is not None:  # what this step leaves out and a later one may train waits
            self.replay.keep(prompts, rollouts, rewards, g.group_size,
                             waiting_groups(rewards, lengths, g, fresh, keep))
        extra = None
        # a trainer whose row count is fixed, or a step with every group stale (no row left to make a batch of)
        masked = keep is not None and (self.cfg.backend.trainer != "embedded" or not any(keep))
        if keep is not None and not masked:  # stale groups and dynamic sampling's left-out ones leave the update
            extra = self.drafter_extra(prompts, rollouts.outs, keep)
            prompts = [p for p, k in zip(prompts, keep) if k]
            rollouts = dataclasses.replace(rollouts, outs=[o for o, k in zip(rollouts.outs, keep) if k])
        with timer("logprob"):
            batch, behaviour = make_batch(prompts, rollouts.outs)
            if masked:  # a trainer whose row count is fixed: the rows stay, with no generated token counted
                batch.mask, advantages = leave_out_rows(batch.mask, advantages, keep)
            if rollouts.lag:
                batch.behaviour_logprobs = behaviour
            if not g.fold_logprob:  # folded: train_step takes them from its own forward and fills them in
                batch.old_logprobs = self.policy.logprobs(batch)
            generated = batch.mask[:, 1:].clone()
            if rollouts.lag and rc.rejects:  # the config refuses a band with fold_logprob: old is known here
                batch.mask[:, 1:] = rejection_mask(batch.old_logprobs, behaviour, generated, rc.level, rc.reject_low,
                                                   rc.reject_high)
        with timer("train"):
            batch.advantages = advantages
            # Only what this step has: the Megatron trainer's train_step takes the batch alone.
            drafter = {k: v for k, v in (("drafter_extra", extra), ("drafter_budget_s", drafter_budget_s))
                       if v is not None}
            train = {**self.policy.train_step(batch, **drafter), **shaping}
        if rollouts.lag:
            train.update(correction_stats(batch.old_logprobs, behaviour, generated, batch.mask[:, 1:], rc.level))
        with timer("logprob"):
            mismatch = None if rollouts.lag else logprob_mismatch(batch.old_logprobs, behaviour, batch.mask[:, 1:])
        return train, mismatch

    def drafter_extra(self, prompts: list[list[int]], outs, keep: list[bool]):
        """The batch of the first `drafter_train.extra_groups` groups the policy leaves out this step, for the
        drafter to learn from as well; None when there are none or the drafter does not train this step."""
        d, size = self.cfg.drafter_train, self.cfg.grpo.group_size
        # Not on a step the gate runs plainly, nor for a drafter that does not train online.
        if not d.extra_groups or not d.online or not self.policy.trains_drafter_online:
            return None
        n = d.extra_groups
        left = [i for i in range(0, len(outs), size) if not keep[i]][:n]
        rows = [r for i in left for r in range(i, i + size)]
        return make_batch([prompts[r] for r in rows], [outs[r] for r in rows])[0] if rows else None

    @staticmethod
    def metrics(step: int, timer: StageTimer, outs, rewards: torch.Tensor, mismatch: float | None, train: dict) -> dict:
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
        self.refit()
        problems = self.eval_task.problems(0, self.cfg.run.eval_prompts)
        outs = self.generator.generate([self.eval_task.encode(p) for p in problems],
                                       SamplingParams(temperature=0, max_tokens=self.cfg.grpo.max_tokens))
        return sum(self.eval_task.rewards([o.token_ids for o in outs], problems)) / len(problems)

    def close(self) -> None:
        """Release what the run holds beyond this process: a vLLM generator's engine processes (the Ray trainer also
        shuts its worker groups down) and the reward workers."""
        self.generator.close()
        self.task.close()


def train(cfg: RLConfig) -> dict:
    """Run (or resume) the RL job described by `cfg`; returns a summary of the last step. Placements other than
    `inline` run the same loop through the Ray driver. Hub names among the checkpoints are fetched first, here."""
    from ..models.hub import resolve_config

    cfg = resolve_config(cfg)
    check_inputs(cfg)
    if cfg.backend.placement != "inline":  # the driver is named, not imported here: the core never imports Ray
        from .backends import DRIVERS, resolve

        return resolve(DRIVERS, cfg.backend.placement, "placement")(cfg)
    return run(cfg, Trainer)


def run(cfg: RLConfig, make_trainer, stop: StopRequest | None = None, clock=time.monotonic) -> dict:
    """The outer loop of every placement: resume, then per step `trainer.step` (+ evaluation), log, stop after
    `grpo.max_nan_steps` non-finite losses, checkpoint. `make_trainer(cfg)` builds the `Trainer` (or subclass).

    Checkpoints come every `run.save_every` steps, once `run.save_every_s` seconds (by `clock`) have passed, and at
    the end. On SIGUSR1 or SIGTERM (`stop`, whose handlers it installs) it finishes the step in flight, saves at that
    boundary and returns its metrics with `stopped_on` (the signal's name): the run is resumable, not failed.
    Cadence saves are written in the background with `run.async_save` (`checkpoint.Saver`); the one at the end or on
    a signal is complete before it returns."""
    stop = stop or StopRequest()
    with stop.installed():  # from the start: a signal while the trainer builds stops the run before its first step
        return _run(cfg, make_trainer, stop, clock)


def _run(cfg: RLConfig, make_trainer, stop: StopRequest, clock) -> dict:
    from .logging import StepLogger

    torch.set_num_threads(cfg.run.threads)
    run_dir = Path(cfg.run.out_dir)
    saved = checkpoint.load_latest(run_dir) if cfg.run.resume else None
    if saved is not None:
        checkpoint.check_same_config(saved["config"], cfg, run_dir)
    else:  # before the trainer is built: its backends write into run_dir (a vLLM engine's exported checkpoint)
        moved = checkpoint.set_aside_earlier_run(run_dir)
        if moved is not None:
            print(f"starting from step 0: what an earlier run left in {run_dir} is now in {moved}")
    torch.manual_seed(cfg.run.seed)
    trainer = make_trainer(cfg)
    start = 0
    if saved is not None:
        trainer.policy.load_state_dict(saved["state"])
        torch.set_rng_state(saved["rng"])
        trainer.load_loop_state(saved)
        start = saved["step"] + 1
        print(f"resumed from {run_dir}/checkpoints (step {saved['step']})")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    # a resumed run re-runs the steps after its checkpoint: their earlier records (TensorBoard's too) go
    logger = StepLogger(run_dir, cfg.run.steps, loggers=cfg.run.loggers, config=dataclasses.asdict(cfg),
                        project=cfg.run.logger_project, purge_step=start if saved is not None else None)
    nan_streak, metrics = 0, {}
    save_clock = SaveClock(cfg.run.save_every_s, clock)
    checkpoint.clear_interrupted(run_dir)
    saver = checkpoint.Saver(run_dir, background=cfg.run.async_save)
    try:
        # The policy as loaded, so that a run's gain is measured from where it started (step 0's eval is after an
        # update); logged with step 0's metrics.
        before = trainer.evaluate() if start == 0 and cfg.run.eval_every else None
        for step in logger.progress(range(start, cfg.run.steps)):
            if step == start and stop.requested:  # before this process's first step: nothing new to save
                print(f"{stop.name} before step {step}: nothing new to save; stopping (exit 0)", flush=True)
                metrics = {"stopped_on": stop.name}
                break
            metrics = trainer.step(step)
            last = step == cfg.run.steps - 1
            if step == 0 and before is not None:
                metrics["eval_accuracy_before"] = before
            if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last):
                metrics["eval_accuracy"] = trainer.evaluate()
            # Peak memory of the step (this process, its children, and what the trainer reports per rank).
            metrics["memory"] = {**metrics.get("memory", {}), **memory.step_memory()}
            nan_streak = nan_streak + 1 if metrics["skipped"] or not math.isfinite(metrics["loss"]) else 0
            failed = nan_streak >= cfg.grpo.max_nan_steps
            signalled = stop.name  # read once: a signal arriving after this is seen at the next boundary
            why = None if failed else save_due(step, cfg.run, save_clock, signalled, last)
            if why:  # the policy writes its own shards, if sharded; the last save before exit is never left running
                metrics.update(saver.save(step, trainer.policy, cfg, trainer.loop_state(),
                                          background=None if why in ("save_every", "save_every_s") else False))
                save_clock.saved()
            else:
                metrics.update(saver.poll())  # a background save that finished during the step gets its name
            logger.log(metrics)
            if failed:
                raise RuntimeError(f"{nan_streak} consecutive steps with a non-finite loss (last at step {step}); "
                                   f"stopping. The last good checkpoint is in {run_dir}/checkpoints")
            if signalled and not last:
                print(f"{signalled}: saved {run_dir}/checkpoints/step_{step:06d} after step {step} of "
                      f"{cfg.run.steps}; stopping (exit 0), a resubmission resumes there", flush=True)
                metrics = {**metrics, "stopped_on": signalled}
                break
        saver.wait()  # a background save still in flight (a run that ends without a save of its own) is completed
    finally:
        logger.close()
        trainer.close()
        if cfg.run.report:
            write_run_report(run_dir)
    return metrics


def write_run_report(run_dir: Path) -> None:
    """Every run leaves `report.html` (with its plots) behind, also one that stopped early; a report that cannot be
    written is a warning, never the error that ends the run (a failing run's own error must stay visible)."""
    from .report import write_report

    if not (run_dir / "metrics.jsonl").is_file():
        return
    try:
        print(f"report: {write_report([run_dir], run_dir / 'report.html')}")
    except Exception as err:  # noqa: BLE001  (reporting must not mask the run's outcome)
        print(f"report: not written ({type(err).__name__}: {err}); `megatron-spec report {run_dir}` retries")
