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
from .test_loop import ckpts  # noqa: F401  (the tiny checkpoints fixture)


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
    # oldest first: 12 (a version old, offered and left out again), then the step's own, at age 0
    assert [w.outs[0].token_ids[0] for w in t.replay.groups] == [12, 21, 22, 20]
    assert [w.ages for w in t.replay.groups] == [[1, 1], [0, 0], [0, 0], [0, 0]]
    trained, train, _ = step(t, [30, 31, 32])
    assert train["groups_dropped_stale"] == 1  # group 12 is two versions old now, past the bound
    assert trained == [21]
    assert 12 not in [w.outs[0].token_ids[0] for w in t.replay.groups]


def test_a_step_offered_waiting_groups_keeps_its_size():
    """2 groups waiting, a step of 3: the step gets the 2 (a version older) and its first own group, in that order,
    and its other 2 wait as they are; a trainer with a fixed row count (split over data-parallel ranks) sees 6."""
    replay = Replay()
    old = [SimpleNamespace(token_ids=[n]) for n in (1, 1, 2, 2)]
    replay.keep([[0]] * 4, Rollouts(old, lag=0), torch.zeros(4), 2, [0, 1])
    own = [SimpleNamespace(token_ids=[n]) for n in (10, 10, 11, 11, 12, 12)]
    prompts, rollouts, rewards = replay.offer([[0]] * 6, Rollouts(own, lag=0), torch.ones(6), 2)
    assert [o.token_ids[0] for o in rollouts.outs] == [1, 1, 2, 2, 10, 10]
    assert rollouts.ages == [1, 1, 1, 1, 0, 0] and rollouts.lag == 1 and rewards.tolist() == [0, 0, 0, 0, 1, 1]
    assert len(prompts) == 6
    assert [(w.outs[0].token_ids[0], w.ages) for w in replay.groups] == [(11, [0, 0]), (12, [0, 0])]


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


def test_loop_run_trains_a_left_out_group_a_step_later_and_drops_an_older_one(ckpts, tmp_path, monkeypatch):
    """Three real steps (tiny policy, embedded pair, no speculation), 3 groups of 3 a step, `train_groups=1`,
    `max_trajectory_age=1`, every group's rewards (1, 0, 0): step 0 leaves 2 groups waiting; step 1 is offered
    them first and trains the older of them (nothing stale), leaving the other, now a version old, waiting with its
    own 3 (the step keeps its size: the 2 replayed take the places of 2 of its own, which wait); step 2 is offered
    3 of the 4 waiting and drops the oldest of them, two versions old, as stale."""
    from megatron_spec.rl import loop
    from megatron_spec.rl.logging import read_metrics

    from .test_loop import small_cfg

    monkeypatch.setattr(loop.Trainer, "score", lambda self, problems, outs: torch.tensor([1.0, 0.0, 0.0] * 3))
    cfg = small_cfg(ckpts, tmp_path, spec=None, train_groups=1, max_trajectory_age=1)
    loop.run(cfg, loop.Trainer)
    m = read_metrics(tmp_path)
    assert [s["groups_replayed"] for s in m] == [0, 2, 3]
    assert [s["groups_dropped_stale"] for s in m] == [0, 0, 1]
    assert [s["groups_waiting"] for s in m] == [2, 4, 5]
    assert m[0]["logprob_mismatch"] is not None and m[1]["logprob_mismatch"] is None  # step 1 trains replayed rows


def test_resume_keeps_the_waiting_groups(ckpts, tmp_path, monkeypatch):
    """4 steps straight against 3 steps, stop, resume to 4, under `train_groups=1` and `max_trajectory_age=2`, with
    the rewards varying by rollout: the groups waiting at the checkpoint are in it, so the resumed step replays,
    drops and trains what the straight run did (same counts, losses and rewards) and ends on the same weights. A
    resume that lost them would replay nothing at step 3."""
    from megatron_spec.rl import loop
    from megatron_spec.rl.logging import read_metrics

    from .test_loop import small_cfg

    monkeypatch.setattr(loop.Trainer, "score", lambda self, problems, outs: torch.tensor(
        [float(sum(o.token_ids) % 3 == 0) for o in outs]))
    runs = {}
    for name, stops in (("full", [4]), ("part", [3, 4])):
        cfg = small_cfg(ckpts, tmp_path / name, spec=None, train_groups=1, max_trajectory_age=2)
        cfg.run.save_every = 1
        for steps in stops:
            cfg.run.steps = steps
            loop.run(cfg, loop.Trainer)
        runs[name] = read_metrics(tmp_path / name)
    keys = ["groups_replayed", "groups_waiting", "groups_dropped_stale", "loss", "reward_mean"]
    assert [[m[k] for k in keys] for m in runs["full"]] == [[m[k] for k in keys] for m in runs["part"]]
    assert runs["part"][2]["groups_waiting"] > 0 and runs["part"][3]["groups_replayed"] > 0
    w = [torch.load(tmp_path / n / "checkpoints/step_000003/state.pt", weights_only=False)["state"]["model"]
         for n in ("full", "part")]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])
