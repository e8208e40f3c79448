"""How many optimizer steps the online drafter takes per RL step: one per minibatch of every replayed step, the
replay filling one step at a time; and the main job's setting, which its freshness runs chose by that count."""

import pytest

from megatron_spec.rl.config import DrafterTrainSection
from recipes.tiny_grpo_spec import tiny_grpo_spec
from tests.rl.test_policy import make_policy, off_policy, rollout_batch, run_step


@pytest.mark.parametrize("replay,minibatches", [(1, 1), (4, 2), (2, 8)])
def test_optimizer_steps_per_rl_step(replay, minibatches):
    """16 rows a batch in one micro-batch (no token budget), so each of up to 16 minibatches gets rows: RL step i takes min(i + 1, replay) x minibatches
    optimizer steps, exactly. Counted on the drafter's AdamW; a wrong deal (a minibatch dropped or doubled) or a
    replay that does not fill or overfills changes the count."""
    policy = make_policy(0, "mtp", drafter_cfg=DrafterTrainSection(replay=replay, minibatches=minibatches))
    calls = []
    step = policy.drafter_opt.step
    policy.drafter_opt.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    for i in range(4):
        batch = rollout_batch(seed=10 + i)
        before = len(calls)
        run_step(policy, batch, off_policy(policy, batch, seed=i))
        assert len(calls) - before == min(i + 1, replay) * minibatches, i


def test_main_job_takes_eight_drafter_steps_of_sixteen_rows():
    """The main job trains 4 groups of 8 rollouts a step (32 rows) and its head replays 4 steps in 2 minibatches:
    8 optimizer steps of 16 rows an RL step, where 8 minibatches of 4 rows (32 steps) left the head at a lower
    acceptance length (research/drafter_freshness)."""
    cfg = tiny_grpo_spec()
    rows = cfg.grpo.train_groups * cfg.grpo.group_size
    d = cfg.drafter_train
    assert (rows, d.replay * d.minibatches * d.updates, rows // d.minibatches) == (32, 8, 16)
