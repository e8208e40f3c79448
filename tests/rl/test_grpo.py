"""Golden values for the GRPO pure functions, computed by hand in the docstrings."""

import pytest
import torch

from megatron_spec.rl.grpo import aggregate, group_advantages, kl_k3, policy_loss


def test_group_advantages_golden():
    """Group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> [1, -1, -1, 1]; without std: [0.5, -0.5, -0.5, 0.5].
    An all-equal group gets exactly zero."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(group_advantages(r), torch.tensor([[1.0, -1, -1, 1], [0, 0, 0, 0]]), atol=1e-5)
    assert torch.allclose(group_advantages(r, normalize_std=False), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]))


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
