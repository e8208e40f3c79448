"""Golden values for the GRPO pure functions, computed by hand in the docstrings."""

import pytest
import torch

import math
from types import SimpleNamespace

from megatron_spec.rl.config import GRPOSection
from megatron_spec.rl.grpo import (aggregate, group_advantages, kl_k3, kl_penalty, overlong_penalty, policy_loss,
                                   uniform_groups)
from megatron_spec.rl.loop import step_advantages


def test_group_advantages_golden():
    """Group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> [1, -1, -1, 1]; without std: [0.5, -0.5, -0.5, 0.5].
    An all-equal group gets exactly zero."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(group_advantages(r), torch.tensor([[1.0, -1, -1, 1], [0, 0, 0, 0]]), atol=1e-5)
    assert torch.allclose(group_advantages(r, std="none"), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]))


def test_policy_loss_golden_and_asymmetric_clip():
    """One token, A = +1, ratio e^0.5 = 1.6487: clipped at 1 + 0.2 -> loss -1.2; with clip_high 0.28 -> -1.28
    (DAPO's clip-higher). A = -1, ratio e^-0.5 = 0.6065: min(-0.6065, -0.8) = -0.8 -> loss 0.8 (clipped)."""
    lp, old, mask = torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.tensor([[True]])
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"] == 1.0
    loss, _ = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    loss, _ = policy_loss(-lp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(0.8)
    loss, m = policy_loss(old, old, torch.tensor([2.0]), mask)  # on-policy: ratio 1, no clip, loss -A
    assert loss.item() == pytest.approx(-2.0) and m["clip_frac"] == 0.0


def test_token_vs_sequence_aggregation():
    """Values [[1, 1, 1], [4, -, -]]: token mean (1+1+1+4)/4 = 1.75; sequence mean (1 + 4)/2 = 2.5."""
    v = torch.tensor([[1.0, 1, 1], [4, 9, 9]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert aggregate(v, mask, "token").item() == pytest.approx(1.75)
    assert aggregate(v, mask, "sequence").item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(v, mask, "batch")


def test_kl_k3_golden():
    """log r = ref - lp = -0.5: e^-0.5 - 1 + 0.5 = 0.10653; zero when the policies agree."""
    assert kl_k3(torch.tensor(0.0), torch.tensor(-0.5)).item() == pytest.approx(0.1065307)
    assert kl_k3(torch.tensor(-1.3), torch.tensor(-1.3)).item() == 0.0


def test_uniform_group_of_an_inexact_reward_gets_exactly_zero():
    """Eight rollouts all scoring 0.3 (no exact binary form): the float32 mean rounds away from 0.3 and dividing that
    rounding by std + eps (~1e-6) made +0.029; every baseline and std must give exactly 0, and a mixed group beside
    it keeps its signal."""
    r = torch.tensor([[0.3] * 8, [0.3, 0.7] * 4])
    for baseline in ("mean", "leave_one_out"):
        for std in ("population", "sample", "none"):
            adv = group_advantages(r, baseline, std)
            assert adv.dtype == torch.float32
            assert adv[0].tolist() == [0.0] * 8
            assert (adv[1] != 0).all()
    assert uniform_groups(r).tolist() == [True, False]


def reference_advantages(rewards: list[list[float]], baseline: str, std: str, eps: float = 1e-6):
    out = []
    for group in rewards:
        g = len(group)
        mean = sum(group) / g
        var = sum((x - mean) ** 2 for x in group) / (g - 1 if std == "sample" else g)
        row = []
        for i, x in enumerate(group):
            base = (sum(group) - x) / (g - 1) if baseline == "leave_one_out" else mean
            a = x - base
            if std != "none":
                a /= math.sqrt(var) + eps
            row.append(0.0 if len(set(group)) == 1 else a)
        out.append(row)
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("std", ["population", "sample", "none"])
def test_advantages_match_explicit_loops(baseline, std):
    """Each option against a float64 loop over every rollout (the leave-one-out mean of the other G - 1 rewards,
    the std over G or G - 1). Rewards on a 0.1 grid so that some groups tie or are uniform."""
    g = torch.Generator().manual_seed(0)
    r = (torch.randint(0, 4, (16, 8), generator=g) / 10).float()
    r[3] = 0.3
    expected = torch.tensor(reference_advantages(r.double().tolist(), baseline, std), dtype=torch.float64)
    assert torch.allclose(group_advantages(r, baseline, std).double(), expected, atol=1e-6, rtol=1e-6)


def test_sample_std_and_leave_one_out_scale_the_mean_advantages():
    """Relations that pin the definitions: at G = 8, sample-std advantages are sqrt(7/8) = 0.935x the population
    ones (NeMo-RL's are 1 / 1.069 of ours), and leave-one-out ones are G / (G - 1) = 8/7 x the mean's."""
    r = torch.tensor([[1.0, 0, 0, 1, 1, 0, 0, 0]])
    pop, samp = group_advantages(r), group_advantages(r, std="sample")
    assert torch.allclose(samp, pop * math.sqrt(7 / 8), atol=1e-5)
    assert torch.allclose(group_advantages(r, "leave_one_out", "none"), group_advantages(r, std="none") * 8 / 7)


def test_dual_clip_matches_an_explicit_loop():
    """Per token in float64: PPO's max(-r A, -clip(r) A), then for A < 0 the cap min(that, -c A). Ratios up to e^2
    so that the cap is active on some negative-advantage tokens and the plain clip elsewhere."""
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(6, 5, generator=g, dtype=torch.float64)
    old = lp - torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([2.0, -1.5, -0.5, 1.0, -3.0, 0.7], dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) < 0.8
    c, lo, hi = 3.0, 0.2, 0.28
    total, count, capped = 0.0, 0, 0
    for i in range(6):
        for t in range(5):
            if not mask[i, t]:
                continue
            r, a = math.exp(lp[i, t] - old[i, t]), float(adv[i])
            loss = max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)
            if a < 0 and -c * a < loss:
                loss, capped = -c * a, capped + 1
            total, count = total + loss, count + 1
    assert capped > 0
    loss, _ = policy_loss(lp, old, adv, mask, lo, hi, "token", dual_clip_c=c)
    assert loss.item() == pytest.approx(total / count, rel=1e-12)
    plain, _ = policy_loss(lp, old, adv, mask, lo, hi, "token")
    assert plain.item() > loss.item()  # the cap only lowers losses


def test_sequence_level_ratio_is_gspo():
    """GSPO: s_i = exp(mean over sequence i's tokens of (lp - old)), loss -mean_i min(s_i A_i, clip(s_i) A_i).
    Written here directly on s_i (autograd through the exp of the mean), value and gradient equal the
    token-form implementation's with `agg="sequence"`; clips wide enough that some sequences are clipped."""
    g = torch.Generator().manual_seed(2)
    B, T = 5, 7
    base = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = base - 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = mask[3, 2:] = False
    lo, hi = 0.05, 0.05
    lp_ref = base.clone().requires_grad_(True)
    terms, clipped = [], 0
    for i in range(B):
        n = int(mask[i].sum())
        s = torch.exp(sum(lp_ref[i, t] - old[i, t] for t in range(n)) / n)
        a = float(adv[i])
        clipped += not (1 - lo <= s.item() <= 1 + hi)
        terms.append(-torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a))
    ref = sum(terms) / B
    ref.backward()
    assert clipped > 0
    lp = base.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, lo, hi, "sequence", ratio_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(lp.grad, lp_ref.grad, atol=1e-12)
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(lp, old, adv, mask, ratio_level="batch")


def test_overlong_penalty_matches_dapo_piecewise():
    """DAPO's soft punishment with L_max = 20, buffer 8: 0 up to 12 tokens, (12 - L) / 8 on (12, 20], scaled by
    the penalty (0.5 here)."""
    lengths = torch.arange(0, 23)
    expected = [0.0 if n <= 12 else 0.5 * max((12 - n) / 8, -1.0) for n in range(23)]
    assert overlong_penalty(lengths, 20, 8, 0.5).tolist() == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 23
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 21)


def expected_gradient(estimator: str, theta: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """E_{x ~ pi}[grad_theta k(x)] by enumeration of the vocabulary, the sampling weights pi(x) held fixed (a loss
    term's gradient at tokens the policy sampled)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp().detach()
    (pi * kl_penalty(logp, ref_logp, estimator)).sum().backward()
    return theta.grad


def test_kl_estimators_have_the_gradients_their_docstring_names():
    """On a 6-token categorical, the exact expected gradient of each estimator against autograd of the closed
    forms: k3 -> KL(ref || pi), k2 -> KL(pi || ref), k1 -> 0. k3's value is KL(pi || ref) in expectation."""
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(6, generator=g, dtype=torch.float64)
    ref_logp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)

    def closed(forward: bool) -> torch.Tensor:
        t = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(t, -1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum() if forward else (logp.exp() * (logp - ref_logp)).sum()
        kl.backward()
        return t.grad

    forward, reverse = closed(True), closed(False)
    assert not torch.allclose(forward, reverse, atol=1e-3)
    assert torch.allclose(expected_gradient("k3", theta, ref_logp), forward, atol=1e-12)
    assert torch.allclose(expected_gradient("k2", theta, ref_logp), reverse, atol=1e-12)
    assert torch.allclose(expected_gradient("k1", theta, ref_logp), torch.zeros(6, dtype=torch.float64), atol=1e-12)
    logp = torch.log_softmax(theta, -1)
    value = (logp.exp() * kl_penalty(logp, ref_logp, "k3")).sum()
    assert value.item() == pytest.approx((logp.exp() * (logp - ref_logp)).sum().item(), rel=1e-12)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref_logp, "k4")


def test_step_advantages_shapes_and_drops_uniform_groups():
    """Three groups of 4 (max_tokens 10, buffer 4): group 0 uniform (all 1), group 1 uniform in reward but one
    rollout 10 tokens long (shaped to 1 - 1 = 0: no longer uniform), group 2 mixed. Dropping uniform groups keeps
    rows 4-11 and their advantages; when every group is uniform nothing is dropped."""
    g = GRPOSection(group_size=4, prompts_per_step=3, max_tokens=10, overlong_buffer=4, drop_uniform_groups=True)
    rewards = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1])
    lengths = [3] * 7 + [10] + [3] * 4
    adv, keep, info = step_advantages(rewards, lengths, g)
    assert keep == [False] * 4 + [True] * 8
    assert info["uniform_groups"] == 1 and info["groups_dropped"] == 1
    shaped = rewards.double().clone()
    shaped[7] = 0.0
    expected = torch.tensor(reference_advantages(shaped.view(3, 4).tolist(), "mean", "population"),
                            dtype=torch.float64).flatten()[4:]
    assert torch.allclose(adv.double(), expected, atol=1e-6)
    adv, keep, info = step_advantages(torch.ones(12), [3] * 12, g)
    assert keep is None and info["groups_dropped"] == 0 and adv.tolist() == [0.0] * 12


def test_train_groups_keeps_the_first_groups_with_an_advantage():
    """Five groups of 2: 0 and 3 uniform, 1, 2 and 4 mixed. A cap of 2 trains groups 1 and 2 (the first two with an
    advantage, in draw order) with their own advantages, and drops the uniform ones with or without
    `drop_uniform_groups`; a cap above the mixed count keeps all three. A step whose groups are all uniform trains
    its first two (zero advantages)."""
    rewards = torch.tensor([1.0, 1, 0, 1, 1, 0, 0, 0, 0, 1])
    for drop in (False, True):
        g = GRPOSection(group_size=2, prompts_per_step=5, train_groups=2, drop_uniform_groups=drop)
        adv, keep, info = step_advantages(rewards, [3] * 10, g)
        assert keep == [False, False, True, True, True, True, False, False, False, False]
        assert adv.tolist() == pytest.approx([-1.0, 1.0, 1.0, -1.0], abs=1e-5)  # std + eps in the denominator
        assert info["groups_dropped"] == 3
    g = GRPOSection(group_size=2, prompts_per_step=5, train_groups=4)
    adv, keep, info = step_advantages(rewards, [3] * 10, g)
    assert keep == [False, False, True, True, True, True, False, False, True, True] and info["groups_dropped"] == 2
    adv, keep, info = step_advantages(torch.zeros(10), [3] * 10, GRPOSection(group_size=2, prompts_per_step=5,
                                                                             train_groups=2))
    assert keep == [True] * 4 + [False] * 6 and adv.tolist() == [0.0] * 4 and info["groups_dropped"] == 3
    with pytest.raises(ValueError, match="grpo.train_groups must be >= 0"):
        GRPOSection(train_groups=-1)


@pytest.mark.parametrize("bad, match", [
    (dict(baseline="median"), "grpo.baseline"), (dict(std="unbiased"), "grpo.std"),
    (dict(kl_estimator="k4"), "grpo.kl_estimator"), (dict(ratio_level="group"), "grpo.ratio_level"),
    (dict(dual_clip_c=1.0), "dual_clip_c"), (dict(overlong_buffer=200), "overlong_buffer"),
])
def test_loss_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        GRPOSection(**bad)


def test_a_checkpoint_with_normalize_std_resumes_as_its_std():
    """`grpo.normalize_std` (true / false) became `grpo.std` (population / none): a checkpoint saved with the boolean
    resumes under the setting that computes the same advantages, and is refused under another."""
    from megatron_spec.rl import checkpoint
    from megatron_spec.rl.config import RLConfig

    cfg = RLConfig()
    saved = {k: v for k, v in checkpoint.flatten(cfg).items() if k != "grpo.std"}
    checkpoint.check_same_config({**saved, "grpo.normalize_std": True}, cfg, "run")
    with pytest.raises(ValueError, match="grpo.std: saved 'none', now 'population'"):
        checkpoint.check_same_config({**saved, "grpo.normalize_std": False}, cfg, "run")
    cfg.grpo.std = "none"
    checkpoint.check_same_config({**saved, "grpo.normalize_std": False}, cfg, "run")


@pytest.mark.parametrize("agg, ratio_level", [("token", "token"), ("sequence", "token"), ("sequence", "sequence")])
def test_rows_left_out_by_their_mask_give_the_update_without_them(agg, ratio_level):
    """Dynamic sampling under a trainer with a fixed row count (Megatron's, split over data-parallel ranks): the left-
    out groups' rows stay with an empty mask and advantage 0 (`leave_out_rows`). The loss and its gradient equal
    those of the batch without the rows, for each aggregation, to fp32 summation order (the sums have the same
    terms plus exact zeros: 1e-6 relative covers the reordering on any instruction set)."""
    from megatron_spec.rl.loop import leave_out_rows

    gen = torch.Generator().manual_seed(0)
    B, T = 8, 12
    lengths = torch.tensor([12, 3, 7, 1, 9, 12, 5, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=gen) * 3
    new = old + 0.1 * torch.randn(B, T, generator=gen)
    keep = [True, True, False, False, True, True, False, False]  # groups of 2: the second and fourth left out
    kept = torch.tensor(keep)
    advantages = torch.randn(int(kept.sum()), generator=gen)

    def loss_and_grad(rows, m, adv):
        logprobs = new[rows].clone().requires_grad_()
        loss, _ = policy_loss(logprobs, old[rows], adv, m, agg=agg, ratio_level=ratio_level)
        loss.backward()
        return loss, logprobs.grad

    dropped_loss, dropped_grad = loss_and_grad(kept.nonzero().flatten(), mask[kept], advantages)
    full_mask, full_adv = leave_out_rows(mask, advantages, keep)
    assert full_mask.sum(1).tolist() == [12, 3, 0, 0, 9, 12, 0, 0] and full_adv[~kept].eq(0).all()
    masked_loss, masked_grad = loss_and_grad(torch.arange(B), full_mask, full_adv)
    torch.testing.assert_close(masked_loss, dropped_loss, rtol=1e-6, atol=0)
    assert masked_grad[~kept].eq(0).all()
    torch.testing.assert_close(masked_grad[kept], dropped_grad, rtol=1e-6, atol=1e-12)
    assert dropped_loss.abs() > 1e-3  # a loss that carries the advantages


def test_dynamic_sampling_is_accepted_with_the_megatron_trainer():
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import check_inputs

    cfg = RLConfig()
    cfg.backend.trainer = "megatron"
    cfg.grpo.drop_uniform_groups, cfg.grpo.train_groups = True, 2
    check_inputs(cfg)
