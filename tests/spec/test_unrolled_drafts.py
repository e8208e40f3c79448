"""Drafter training computes what drafting computes: each trained draft (EAGLE-3's unrolled steps, an MTP head's
depths and its last depth chained past them) at row t is the head's draft from the sequence's first t+2 tokens,
with the true tokens standing in for accepted drafts. Chained drafts are only worth training in this context."""

import pytest
import torch

from megatron_spec.models import MTP, CausalLM, Eagle3Head, MTPConfig, preset
from megatron_spec.spec.drafter_loss import TRAINED_DRAFTS, depth_pairs


def drafted_logits(target, head, tokens: list[int], k: int) -> torch.Tensor:
    """The logits of drafts 1..k as the engine drafts them (`proposers/hidden.py`; test_engine_spec holds the
    engine's drafts to this construction): every depth over the sequence with full forwards, then the last depth
    chained on its own last state, one position on per draft; the sequence's own continuation stands in for the
    drafts (here `tokens` holds the prefix and the k tokens after it)."""
    is_mtp = isinstance(head, MTP)
    depths = len(head.layers) if is_mtp else 1
    L = len(tokens) - k

    def run(depth, h, ids):
        if is_mtp:
            return head(h, torch.tensor([ids]), None, target.embed, target.lm_head, layer=depth)
        return head(h, torch.tensor([ids]), None, target.embed)

    with torch.no_grad():
        out = target.trunk(torch.tensor([tokens[: L - 1]]), capture=() if is_mtp else head.capture_layers)
        hidden = out.hidden if is_mtp else head.fuse(out.layers)
        found = []
        for j in range(k):
            depth = min(j, depths - 1)
            if j < depths:
                inputs = hidden
                hidden, logits = run(depth, hidden, tokens[j + 1 : j + L])
                state = hidden[:, -1:]
            else:
                inputs = torch.cat([inputs, state], 1)
                n = inputs.shape[1]
                out_state, logits = run(depth, inputs, tokens[depth + 1 : depth + 1 + n])
                state = out_state[:, -1:]
            found.append(logits[0, -1])
    return torch.stack(found)


@pytest.mark.parametrize("method,layers", [("eagle3", 0), ("mtp", 1), ("mtp", 2)])
def test_trained_drafts_are_the_drafted_ones(method, layers):
    """A random tiny target and head (std 0.15, so states differ visibly between contexts), one 14-token sequence:
    for every row t, trained draft j's logits equal draft j+1's logits drafted from tokens[:t+2], to fp32 rounding.
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
        pairs = depth_pairs(method, target, head, ids, torch.ones_like(ids, dtype=torch.bool), out,
                            target.lm_head(out.hidden))
    assert len(pairs) == TRAINED_DRAFTS
    for t in range(10):
        want = drafted_logits(target, head, tokens[: t + 2 + TRAINED_DRAFTS], TRAINED_DRAFTS)
        for j, pair in enumerate(pairs):
            torch.testing.assert_close(pair.student[0, t], want[j], atol=2e-5, rtol=1e-4)
