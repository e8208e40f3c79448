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
    step = policy.drafter_trainer.opt.step
    policy.drafter_trainer.opt.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    for i in range(4):
        batch = rollout_batch(seed=10 + i)
        before = len(calls)
        run_step(policy, batch, off_policy(policy, batch, seed=i))
        assert len(calls) - before == min(i + 1, replay) * minibatches, i


def test_main_job_drafter_learns_every_group_of_the_step_in_eight_steps():
    """The main job generates 24 groups of 8 rollouts and trains the policy on 4; its head learns from those and the
    other 20 groups (`extra_groups`, the states of a forward after the update), with no replay, in 8 optimizer
    steps, at lr 1e-3, drafting with its weights' average at decay 0.97: the setting that held the forced k = 3 runs'
    acceptance at 0.98 / 0.97 of its start, where the 4 trained groups alone held 0.94 (research/drafter_freshness)."""
    cfg = tiny_grpo_spec()
    d = cfg.drafter_train
    assert cfg.grpo.train_groups + d.extra_groups == cfg.grpo.prompts_per_step == 24
    assert (d.replay, d.minibatches, d.updates, d.lr, d.ema) == (1, 8, 1, 1e-3, 0.97)


def test_the_drafting_weights_are_the_average_of_the_trained_ones():
    """`drafter_train.ema = 0.8`, replay 2 x 2 minibatches, 3 RL steps: after each optimizer step the exported
    drafter tensors (what the refit sends the generator) are 0.8 x their previous value + 0.2 x the trained weights,
    recomputed here from the trained weights seen after every step (float32, to 1e-6 after 10 steps of lerp
    rounding); they differ from the trained weights (by more than 1e-4 somewhere), and the trained weights are
    the ones that learn. A checkpoint restores the average exactly."""
    import torch

    from megatron_spec.refit import DRAFTER_PREFIX

    policy = make_policy(0, "mtp", drafter_cfg=DrafterTrainSection(replay=2, minibatches=2, ema=0.8))
    expected = {n: p.detach().clone() for n, p in policy.drafter.named_parameters()}
    step = policy.drafter_trainer.opt.step

    def step_and_follow(*a, **k):
        out = step(*a, **k)
        for n, p in policy.drafter.named_parameters():
            expected[n] = 0.8 * expected[n] + 0.2 * p.detach()
        return out

    policy.drafter_trainer.opt.step = step_and_follow
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
    assert all(torch.equal(a, b) for a, b in zip(fresh.drafter_trainer.ema.state_dict().values(),
                                                 policy.drafter_trainer.ema.state_dict().values()))


def test_extra_groups_reach_the_drafter_from_the_updated_policy():
    """`drafter_train.extra_groups`: the drafter's update reads the trained batch's states and, after them, the extra
    rows' from a forward of the policy as the step left it. Checked on what `DrafterTrainer.step` receives: the extra rows
    (8) follow the trained ones (16), their hidden states equal a fresh no-grad trunk forward of the updated model
    (to 1e-6: the same forward, batched alike) and differ from the pre-update model's (by more than 1e-4), and the
    token count covers both batches. Without extra rows, the same step passes the trained rows only."""
    import torch

    policy = make_policy(0, "mtp", drafter_cfg=DrafterTrainSection(extra_groups=1))
    seen = []
    step = policy.drafter_trainer.step
    policy.drafter_trainer.step = lambda target, forwards, tokens, *rest: (seen.append((list(forwards), tokens))
                                                                           or step(target, forwards, tokens))
    batch, extra = rollout_batch(seed=30), rollout_batch(seed=31, rows=8)
    with torch.no_grad():
        before = policy.model.trunk(extra.input_ids).hidden.clone()
    policy.train_step(batch, extra)
    (forwards, tokens), = seen
    rows = [f.input_ids.shape[0] for f in forwards]
    assert sum(rows) == 24 and torch.equal(forwards[-1].input_ids, extra.input_ids)
    assert tokens == float(batch.mask.sum() + extra.mask.sum())
    with torch.no_grad():
        after = policy.model.trunk(extra.input_ids).hidden
    assert (forwards[-1].out.hidden - after).abs().max() < 1e-6
    assert (forwards[-1].out.hidden - before).abs().max() > 1e-4
    seen.clear()
    policy.train_step(rollout_batch(seed=32))
    assert sum(f.input_ids.shape[0] for f in seen[0][0]) == 16


def test_a_drafter_training_past_its_budget_stops_but_still_measures():
    """`train_step(..., drafter_budget_s=0)`: the budget is spent before the drafter's training starts, so none of
    the 8 extra rows is forwarded and no optimizer step starts (the drafting weights, here the average of the trained
    ones, are measured by a pass without gradient first); the step still reports the drafter's loss and agreement,
    and `drafter_cut`. Without a budget, or with one it never reaches, the same step takes all 4 minibatches' steps
    over 24 rows and reports no cut."""
    cfg = DrafterTrainSection(minibatches=4, extra_groups=1, ema=0.9)
    for budget, steps_taken, rows_seen in ((0.0, 0, 16), (None, 4, 24), (1e6, 4, 24)):
        policy = make_policy(0, "mtp", drafter_cfg=cfg)
        calls, seen = [], []
        opt_step, drafter_step = policy.drafter_trainer.opt.step, policy.drafter_trainer.step
        policy.drafter_trainer.opt.step = lambda *a, **k: calls.append(1) or opt_step(*a, **k)
        policy.drafter_trainer.step = lambda m, f, t, d: (seen.append(sum(x.input_ids.shape[0] for x in f))
                                                          or drafter_step(m, f, t, d))
        metrics = policy.train_step(rollout_batch(seed=40), rollout_batch(seed=41, rows=8), drafter_budget_s=budget)
        assert (len(calls), seen) == (steps_taken, [rows_seen]), budget
        assert metrics.get("drafter_cut", False) is (budget == 0.0)
        assert metrics["drafter_loss"] > 0 and metrics["drafter_agreement"][0] is not None
