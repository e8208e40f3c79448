"""Offline drafter initialisation on the target's own generations raises acceptance (shipped tiny target)."""

from pathlib import Path

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter, save_drafter
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.drafters.loss import soft_cross_entropy
from megatron_spec.rl.train_drafter import capture_layers, new_drafter, rollouts, task_prompts, train

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-qwen3"


def acceptance_length(target, method, drafter, prompts) -> float:
    outs = LLMEngine(target, spec=SpecConfig(method, 3), drafter=drafter).generate(
        prompts, SamplingParams(temperature=0, max_tokens=48))
    acc = sum(o.spec.get("accepted", 0) for o in outs)
    steps = sum(o.spec.get("verify_steps", 0) for o in outs)
    return (acc + steps) / steps


def test_soft_cross_entropy_golden():
    """Teacher p = [0.5, 0.5], student q = softmax([0, 0]) = [0.5, 0.5]: H(p, q) = ln 2; masked rows ignored."""
    student = torch.zeros(1, 2, 2)
    teacher = torch.tensor([[[0.0, 0.0], [9.0, -9.0]]])
    assert soft_cross_entropy(student, teacher, torch.tensor([[True, False]])).item() == pytest.approx(0.693147, abs=1e-6)


@pytest.mark.skipif(not TARGET.is_dir(), reason=f"shipped tiny checkpoint missing at {TARGET}")
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_training_raises_acceptance_and_roundtrips(method, tmp_path):
    """A fresh head accepts almost nothing (acceptance length ~1); after 60 steps of soft cross-entropy on 96
    target rollouts its greedy acceptance length on held-out prompts rises by at least 0.5 token per verify step,
    and the saved checkpoint reproduces the same acceptance."""
    torch.manual_seed(0)
    target = from_pretrained(TARGET)
    drafter = new_drafter(method, target, None)
    held_out = task_prompts(str(TARGET), 12, seed=99, split="eval")
    before = acceptance_length(target, method, drafter, held_out)
    ids, mask, feats = rollouts(target, task_prompts(str(TARGET), 96, seed=1), max_tokens=48, temperature=1.0, seed=1,
                                capture=capture_layers(method, target, drafter))
    losses = train(target, drafter, method, ids, mask, steps=60, batch_size=16, lr=3e-3, seed=0, log_every=0,
                   feats=feats)
    assert losses[-1] < 0.5 * losses[0]
    after = acceptance_length(target, method, drafter, held_out)
    assert after >= before + 0.5
    save_drafter(drafter, tmp_path / "d", method, target.config)
    again = acceptance_length(target, method, load_drafter(tmp_path / "d", target.config), held_out)
    assert again == after
