"""The replay of finished groups under `grpo.max_trajectory_age`: groups a step leaves out wait, a later step trains
them first while young enough, older ones are dropped and counted, and without a bound nothing changes.

Crafted steps through `Trainer.with_replay` + `Trainer.learn` with a recording trainer: 3 groups of 2 one-token
rollouts a step, each group's token naming it, rewards (1, 0) in every group (a signal) unless a test says so,
`train_groups=1` (the step trains one group and leaves the others out)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_spec.interfaces import Rollouts
from megatron_spec.rl.config import GRPOSection, RLConfig
from megatron_spec.rl.loop import StageTimer, Trainer
from megatron_spec.rl.replay import Replay

from .test_correction import RecordingPolicy


def trainer(max_age: int | None) -> Trainer:
    t = object.__new__(Trainer)
    t.cfg = RLConfig()
    t.cfg.grpo = GRPOSection(group_size=2, prompts_per_step=3, fold_logprob=False, train_groups=1,
                             max_trajectory_age=max_age)
    t.policy = RecordingPolicy(torch.full((64, 1), -1.0))
    t.replay = Replay() if max_age is not None else None
    return t


def step(t: Trainer, names: list[int], rewards: list[float] | None = None):
    """One crafted step on groups named `names` (fresh rollouts, age 0): the tokens of the groups trained (their
    rows left in the batch's mask), and the step's metrics."""
    outs = [SimpleNamespace(token_ids=[n], logprobs=[-1.0]) for n in names for _ in range(2)]
    r = torch.tensor(rewards if rewards is not None else [1.0, 0.0] * len(names))
    train, _ = t.learn(*t.with_replay([[1]] * len(outs), Rollouts(outs, lag=0), r), StageTimer())
    batch = t.policy.batch
    trained = sorted({int(batch.input_ids[i, 1]) for i in range(len(batch.mask)) if batch.mask[i, 1:].any()})
    return trained, train, batch


def test_left_out_group_is_trained_a_step_later_and_a_too_old_one_dropped():
    t = trainer(max_age=1)
    trained, train, batch = step(t, [10, 11, 12])
    assert trained == [10] and len(t.replay) == 2 and batch.behaviour_logprobs is None  # on-policy step
    assert [w.ages for w in t.replay.groups] == [[0, 0], [0, 0]]
    trained, train, batch = step(t, [20, 21, 22])
    assert trained == [11]  # the oldest waiting group goes first, one version old
    assert train["groups_dropped_stale"] == 0
    assert batch.behaviour_logprobs is not None  # replayed rows are corrected as off-policy
    assert [w.outs[0].token_ids[0] for w in t.replay.groups] == [12, 20, 21, 22]
    assert [w.ages for w in t.replay.groups] == [[1, 1], [0, 0], [0, 0], [0, 0]]
    trained, train, _ = step(t, [30, 31, 32])
    assert train["groups_dropped_stale"] == 1  # group 12 is two versions old now, past the bound
    assert trained == [20]
    assert 12 not in [w.outs[0].token_ids[0] for w in t.replay.groups]


def test_uniform_groups_never_wait():
    t = trainer(max_age=3)
    trained, _, _ = step(t, [10, 11, 12], rewards=[1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert trained == [10] and len(t.replay) == 0  # 11 and 12 have nothing to learn from


def test_without_a_bound_nothing_waits():
    t = trainer(max_age=None)
    assert step(t, [10, 11, 12])[0] == [10]
    trained, train, batch = step(t, [20, 21, 22])
    assert trained == [20] and t.replay is None and batch.behaviour_logprobs is None
    assert "groups_dropped_stale" not in train
