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
    acceptance length; at lr 1e-3, drafting with the weights' average at decay 0.97, which ended the forced k = 3
    runs higher than lr 3e-4 without it on two seeds (research/drafter_freshness)."""
    cfg = tiny_grpo_spec()
    rows = cfg.grpo.train_groups * cfg.grpo.group_size
    d = cfg.drafter_train
    assert (rows, d.replay * d.minibatches * d.updates, rows // d.minibatches) == (32, 8, 16)
    assert (d.lr, d.ema) == (1e-3, 0.97)


def test_the_drafting_weights_are_the_average_of_the_trained_ones():
    """`drafter_train.ema = 0.8`, replay 2 x 2 minibatches, 3 RL steps: after each optimizer step the exported
    drafter tensors (what the refit sends the generator) are 0.8 x their previous value + 0.2 x the trained weights,
    recomputed here from the trained weights seen after every step (float32, to 1e-6 after 10 steps of lerp
    rounding); they differ from the trained weights (by more than 1e-4 somewhere), and the trained weights are
    the ones that learn. A checkpoint restores the average exactly."""
    import torch

    from megatron_spec.rl.refit import DRAFTER_PREFIX

    policy = make_policy(0, "mtp", drafter_cfg=DrafterTrainSection(replay=2, minibatches=2, ema=0.8))
    expected = {n: p.detach().clone() for n, p in policy.drafter.named_parameters()}
    step = policy.drafter_opt.step

    def step_and_follow(*a, **k):
        out = step(*a, **k)
        for n, p in policy.drafter.named_parameters():
            expected[n] = 0.8 * expected[n] + 0.2 * p.detach()
        return out

    policy.drafter_opt.step = step_and_follow
    for i in range(3):
        batch = rollout_batch(seed=20 + i)
        run_step(policy, batch, off_policy(policy, batch, seed=i))
    exported = {n[len(DRAFTER_PREFIX):]: t for n, t in policy.export_weights() if n.startswith(DRAFTER_PREFIX)}
    trained = dict(policy.drafter.named_parameters())
    assert set(expected) <= set(exported)
    assert max((exported[n] - expected[n]).abs().max().item() for n in expected) < 1e-6
    assert max((exported[n] - trained[n]).abs().max().item() for n in expected) > 1e-4
    saved = policy.state_dict()
    fresh = make_policy(0, "mtp", drafter_cfg=DrafterTrainSection(replay=2, minibatches=2, ema=0.8))
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.drafter_ema.state_dict().values(),
                                                 policy.drafter_ema.state_dict().values()))
