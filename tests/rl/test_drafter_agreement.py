"""The drafter's agreement with the policy, measured on the train batch every step (`drafter_train.agreement`): a
freshness signal that exists whether or not the adaptive controller let the drafter draft."""

import copy

import pytest
import torch

from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.models import preset
from megatron_spec.drafters.eagle3.model import Eagle3Config
from megatron_spec.rl import loop
from megatron_spec.rl.config import RLConfig
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.drafters.loss import DepthPair, agreement


def test_agreement_is_the_target_probability_of_the_greedy_draft():
    """Golden values: per depth, the processed target probability of the drafter's argmax, summed over masked
    positions, with the count of those positions. Temperature and top-k change p, as they change acceptance."""
    student = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])  # greedy drafts 1, 0, 2
    teacher = torch.log(torch.tensor([[[0.2, 0.5, 0.3], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]]))
    mask = torch.tensor([[True, True, False]])
    pairs = [DepthPair(student, teacher, mask)]
    sums, counts = agreement(None, pairs, dict(temperature=1.0, top_k=0, top_p=1.0))
    assert counts == [2.0] and sums[0] == pytest.approx(0.5 + 0.1)
    sums, _ = agreement(None, pairs, dict(temperature=1.0, top_k=1, top_p=1.0))  # p is one-hot on the target's top-1
    assert sums[0] == pytest.approx(1.0 + 0.0)
    sums, _ = agreement(None, pairs, dict(temperature=0.5, top_k=0, top_p=1.0))  # p ~ p^2
    assert sums[0] == pytest.approx(0.25 / 0.38 + 0.01 / 0.46)


def test_agreement_maps_a_draft_vocabulary_and_needs_full_logits():
    """An EAGLE-3 head with a draft vocabulary drafts d2t[argmax]: that target id's probability counts, so mass
    outside the draft vocabulary is lost, as it is in verification. Draft-vocabulary teacher logits are refused."""
    cfg = preset("tiny-qwen3")
    head = Eagle3Head(cfg, Eagle3Config(target_num_layers=cfg.num_hidden_layers, draft_vocab_size=3),
                      d2t=torch.tensor([5, 9, 40]))
    student = torch.tensor([[[0.0, 4.0, 1.0]]])  # draft id 1 -> target id 9
    probs = torch.full((1, 1, cfg.vocab_size), 0.5 / (cfg.vocab_size - 1))
    probs[0, 0, 9] = 0.5
    sums, counts = agreement(head, [DepthPair(student, probs.log(), torch.tensor([[True]]))],
                             dict(temperature=1.0, top_k=0, top_p=1.0))
    assert counts == [1.0] and sums[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="full-vocabulary"):
        agreement(head, [DepthPair(student, torch.zeros(1, 1, 3), torch.tensor([[True]]))], dict(temperature=1.0))


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_agreement_predicts_the_measured_first_draft_acceptance(method):
    """The trained tiny drafters at k=1, frozen, three RL steps of 8x8 rollouts: the first draft's acceptance rate
    measured in the rollouts and the agreement on the same rollouts' train batch agree to 0.05 (mean of the three
    steps). Each step verifies ~700 drafts, so sampling noise is ~0.01 per step; what remains is that verification
    visits only the positions after an accepted run, not all of them (measured gap 0.02). An agreement computed
    from the wrong distribution (the drafter's own, unprocessed logits, or unaligned positions) misses by far more."""
    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter = "checkpoints/tiny-qwen3", f"checkpoints/tiny-qwen3-{method}"
    cfg.spec = SpecConfig(method, 1)
    cfg.drafter_train.online = False
    cfg.run.threads, cfg.run.eval_every = 1, 0
    torch.manual_seed(0)
    trainer = loop.Trainer(cfg)
    steps = [trainer.step(s) for s in range(3)]
    measured = sum(m["accepted_per_pos"][0] for m in steps) / 3
    predicted = sum(m["drafter_agreement"][0] for m in steps) / 3
    assert 0.5 < measured < 0.99
    assert abs(predicted - measured) < 0.05, (predicted, measured)


def test_frozen_agreement_changes_no_weight():
    """A frozen drafter's agreement is a forward without gradient: the drafter's weights stay as loaded and the
    policy's update is the one a run without the measurement makes."""
    runs = {}
    for measure in (True, False):
        cfg = RLConfig()
        cfg.model.policy, cfg.model.drafter = "checkpoints/tiny-qwen3", "checkpoints/tiny-qwen3-mtp"
        cfg.spec = SpecConfig("mtp", 2)
        cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.max_tokens = 2, 4, 24
        cfg.drafter_train.online, cfg.drafter_train.agreement = False, measure
        cfg.run.threads, cfg.run.eval_every = 1, 0
        torch.manual_seed(0)
        trainer = loop.Trainer(cfg)
        before = copy.deepcopy(trainer.policy.drafter.state_dict())
        runs[measure] = (trainer.step(0), trainer)
        after = trainer.policy.drafter.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    (with_m, a), (without, b) = runs[True], runs[False]
    assert len(with_m["drafter_agreement"]) == 1 and "drafter_agreement" not in without  # drafter_train.drafts
    for (n, x), y in zip(a.policy.model.named_parameters(), b.policy.model.parameters()):
        assert torch.equal(x, y), n


def test_online_update_trains_as_many_drafts_as_configured():
    """`drafter_train.drafts`: the agreement (and the loss) covers the first `drafts` drafts per position, 1 for
    the first draft only; the first draft's agreement is the same number either way (same weights, same batch)."""
    found = {}
    for drafts in (1, 3):
        cfg = RLConfig()
        cfg.model.policy, cfg.model.drafter = "checkpoints/tiny-qwen3", "checkpoints/tiny-qwen3-mtp"
        cfg.spec = SpecConfig("mtp", 3)
        cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.max_tokens = 2, 4, 24
        cfg.drafter_train.drafts = drafts
        cfg.run.threads, cfg.run.eval_every = 1, 0
        torch.manual_seed(0)
        found[drafts] = loop.Trainer(cfg).step(0)["drafter_agreement"]
    assert len(found[1]) == 1 and len(found[3]) == 3
    assert found[1][0] == pytest.approx(found[3][0], abs=1e-9)
