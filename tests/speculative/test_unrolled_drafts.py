"""Drafter training computes what drafting computes: each trained draft (EAGLE-3's unrolled steps, an MTP head's
depths and its last depth chained past them) at row t is the head's draft from the sequence's first t+2 tokens,
with the true tokens standing in for accepted drafts. Chained drafts are only worth training in this context."""

import pytest
import torch

from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.models import CausalLM, preset
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.drafters.loss import TRAINED_DRAFTS, depth_pairs
from megatron_spec.drafters.registry import drafter_method

from .hidden_reference import reference_hidden_drafts


@pytest.mark.parametrize("method,layers", [("eagle3", 0), ("mtp", 1), ("mtp", 2)])
def test_trained_drafts_are_the_drafted_ones(method, layers):
    """A random tiny target and head (std 0.15, so states differ visibly between contexts), one 14-token sequence:
    for every row t, trained draft j's logits equal draft j+1's logits drafted from tokens[:t+2] with the true
    continuation standing in for the drafts (`hidden_reference`, which the engine's drafting is held to), to fp32
    rounding.
    Training a chained step by running the layer over its own states at every position (the context drafting never
    has) misses by 0.4-3 on these logits."""
    torch.manual_seed(3)
    target = CausalLM(preset("tiny-qwen3")).eval()
    target.reset_parameters(std=0.15)
    head = (Eagle3Head.from_target(target) if method == "eagle3" else MTP(target.config, MTPConfig(layers))).eval()
    head.reset_parameters(std=0.15)
    tokens = torch.randint(3, 60, (14,)).tolist()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = target.trunk(ids, capture=() if method == "mtp" else head.capture_layers)
        pairs = depth_pairs(drafter_method(method).online_loss, target, head, ids,
                            torch.ones_like(ids, dtype=torch.bool), out, target.lm_head(out.hidden))
    assert len(pairs) == TRAINED_DRAFTS
    for t in range(10):
        chained = tokens[t + 2 : t + 2 + TRAINED_DRAFTS]
        _, want = reference_hidden_drafts(target, head, tokens[: t + 2], TRAINED_DRAFTS, chained)
        for j, pair in enumerate(pairs):
            torch.testing.assert_close(pair.student[0, t], want[j], atol=2e-5, rtol=1e-4)
