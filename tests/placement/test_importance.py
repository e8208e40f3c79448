"""Async GRPO's off-policy correction, without Ray: truncated importance weights against a known behaviour policy,
the loss they give, and the embedded trainer applying them when a batch carries behaviour log-probs."""

import copy
import math

import torch

from megatron_spec.rl.grpo import policy_loss, truncated_is_weights
from megatron_spec.interfaces import Batch
from tests.rl.test_policy import make_policy, rollout_batch

PI = torch.tensor([0.1, 0.2, 0.3, 0.4])
"""The old policy (the weights being trained) over a 4-token vocabulary."""
MU = torch.tensor([0.4, 0.3, 0.2, 0.1])
"""The behaviour policy that generated the rollouts (an older version)."""
ADV = torch.tensor([1.0, -2.0, 0.5, 3.0])
"""An advantage per token value."""


def test_weights_are_the_truncated_ratio_of_a_known_behaviour_policy():
    """min(pi/mu, clip) exactly, and the truncation mask where pi/mu > clip (only token 3: 4 > 2)."""
    w, truncated = truncated_is_weights(PI.log(), MU.log(), clip=2.0)
    assert torch.allclose(w, torch.tensor([0.25, 2 / 3, 1.5, 2.0]), atol=1e-6)
    assert truncated.tolist() == [False, False, False, True]
    w_same, none = truncated_is_weights(PI.log(), PI.log(), clip=2.0)
    assert torch.equal(w_same, torch.ones(4)) and not none.any()


def counts_batch(probs: torch.Tensor, n: int = 100):
    """One single-token 'rollout' per row, token x appearing exactly n * probs[x] times: the batch a sampler
    following `probs` produces in expectation. Returns (token ids, per-row log-prob under PI, under MU, advantage)."""
    tokens = torch.cat([torch.full((round(n * float(p)),), x) for x, p in enumerate(probs)])
    return tokens, PI.log()[tokens][:, None], MU.log()[tokens][:, None], ADV[tokens]


def test_weighted_loss_of_behaviour_rollouts_is_the_on_policy_loss():
    """The expectation identity the correction rests on, exactly: rollouts drawn in MU's proportions, weighted by
    PI/MU (clip 5 > every ratio, so nothing is truncated), give the loss and gradient of rollouts in PI's own
    proportions. With clip 2 the loss is the truncated one, sum_x MU_x min(PI_x/MU_x, 2) (-A_x), also exactly."""
    def loss_and_grad(tokens, old, behaviour, adv, clip):
        logits = torch.zeros(4, requires_grad=True)  # the policy being trained, at ratio 1 w.r.t. old = PI
        lp = (torch.log_softmax(logits, -1) + PI.log())[tokens][:, None]  # log(pi) shifted so ratio = exp(0) at 0
        weights = None if behaviour is None else truncated_is_weights(old, behaviour, clip)[0]
        loss, _ = policy_loss(lp - math.log(0.25), old, adv, torch.ones_like(old, dtype=torch.bool), is_weights=weights)
        loss.backward()
        return float(loss.detach()), logits.grad

    tokens, old, behaviour, adv = counts_batch(MU)
    on_tokens, on_old, _, on_adv = counts_batch(PI)
    off_loss, off_grad = loss_and_grad(tokens, old, behaviour, adv, clip=5.0)
    on_loss, on_grad = loss_and_grad(on_tokens, on_old, None, on_adv, clip=5.0)
    assert abs(off_loss - on_loss) < 1e-6 and abs(on_loss + float((PI * ADV).sum())) < 1e-6
    assert torch.allclose(off_grad, on_grad, atol=1e-6)
    truncated_loss, _ = loss_and_grad(tokens, old, behaviour, adv, clip=2.0)
    expected = -float((MU * torch.clamp(PI / MU, max=2.0) * ADV).sum())
    assert abs(truncated_loss - expected) < 1e-6


def test_trainer_applies_the_weights_from_the_batch_behaviour_logprobs():
    """The embedded trainer's update with behaviour log-probs equal to its own old log-probs is the update without
    them, bit for bit (every weight is exp(0) = 1); behaviour log-probs log(4) above the old ones on the first half
    of the rows weigh those rows' tokens by 1/4 (nothing truncated), which changes the loss to exactly what the
    per-token sum gives, and log(4) below them truncates at the default `grpo.rollout_correction.truncate`=2 and
    reports the truncated share."""
    batch = rollout_batch()
    probe = make_policy(0)
    old = probe.logprobs(batch)
    mask = batch.mask[:, 1:]

    def step(behaviour):
        policy = make_policy(0)
        b = copy.copy(batch)
        b.old_logprobs, b.behaviour_logprobs = old.clone(), behaviour
        return policy.train_step(b), policy

    plain, p_plain = step(None)
    same, p_same = step(old.clone())
    assert same["loss"] == plain["loss"] and same["is_clip_frac"] == 0.0 and "is_clip_frac" not in plain
    assert all(torch.equal(a, b) for a, b in zip(p_plain.model.parameters(), p_same.model.parameters()))

    half = torch.zeros_like(old, dtype=torch.bool)
    half[: len(half) // 2] = True
    down, _ = step(torch.where(half, old + math.log(4), old))
    # at ratio 1 each token's surrogate is -w * A; token mean over the whole batch's generated tokens
    per_token = -batch.advantages[:, None] * torch.where(half, 0.25, 1.0)
    expected = float((per_token * mask).sum() / mask.sum())
    assert abs(down["loss"] - expected) < 1e-5 and down["is_clip_frac"] == 0.0
    up, _ = step(torch.where(half, old - math.log(4), old))
    share = float((half & mask).sum() / mask.sum())
    assert abs(up["is_clip_frac"] - share) < 1e-6
    expected_up = float((-batch.advantages[:, None] * torch.where(half, 2.0, 1.0) * mask).sum() / mask.sum())
    assert abs(up["loss"] - expected_up) < 1e-5


def test_micro_batches_carry_the_behaviour_rows():
    """`Batch.select` crops the behaviour log-probs like the old ones."""
    batch = rollout_batch()
    batch.behaviour_logprobs = torch.arange(batch.mask.numel() - batch.mask.shape[0]).view(
        batch.mask.shape[0], -1).float()
    mb = batch.select([2, 5], 6)
    assert torch.equal(mb.behaviour_logprobs, batch.behaviour_logprobs[[2, 5], :5])
    assert isinstance(mb, Batch)
