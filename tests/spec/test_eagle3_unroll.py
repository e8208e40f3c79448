"""EAGLE-3's unrolled training steps compute what drafting computes: the training-time test is only worth its cost
if step s's prediction at row t is the head's s+1-th draft from the sequence's first t+2 tokens."""

import torch

from megatron_spec.models import CausalLM, Eagle3Head, preset
from megatron_spec.spec.drafter_loss import eagle3_pairs


def drafted_logits(target, head, tokens: list[int], chained: list[int]) -> torch.Tensor:
    """The logits of each draft, as the engine drafts (`proposers/hidden.py`, checked against it in
    test_engine_spec): the head over the target's fused features at rows 0..L-2, then chained on its own last
    state, one position on per draft, the chained tokens standing in for accepted drafts."""
    with torch.no_grad():
        out = target.trunk(torch.tensor([tokens[:-1]]), capture=head.capture_layers)
        inputs = head.fuse(out.layers)
        ext = list(tokens) + list(chained)
        state, logits = head(inputs, torch.tensor([ext[1 : len(tokens)]]), None, target.embed)
        found = [logits[0, -1]]
        for j in range(len(chained)):
            inputs = torch.cat([inputs, state[:, -1:]], 1)
            n = inputs.shape[1]
            out_state, logits = head(inputs, torch.tensor([ext[1 : 1 + n]]), None, target.embed)
            state = out_state
            found.append(logits[0, -1])
    return torch.stack(found)


def test_unrolled_steps_predict_what_drafting_predicts():
    """A random tiny target and head (std 0.15, so states differ visibly between contexts), one 14-token
    sequence: for every row t, unrolled step s's logits equal the logits of draft s+1 drafted from tokens[:t+2]
    with the true next tokens chained, to fp32 rounding. Attending to the unrolled step's own states at every
    position instead (the context drafting never has) misses by far more than the tolerance."""
    torch.manual_seed(3)
    target = CausalLM(preset("tiny-qwen3")).eval()
    target.reset_parameters(std=0.15)
    head = Eagle3Head.from_target(target).eval()
    head.reset_parameters(std=0.15)
    tokens = torch.randint(3, 60, (14,)).tolist()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = target.trunk(ids, capture=head.capture_layers)
        pairs = eagle3_pairs(target, head, ids, out, target.lm_head(out.hidden), torch.ones_like(ids, dtype=torch.bool),
                             unroll=3)
    assert len(pairs) == 3
    for t in range(0, 10):
        want = drafted_logits(target, head, tokens[: t + 2], tokens[t + 2 : t + 4])
        for s, pair in enumerate(pairs):
            torch.testing.assert_close(pair.student[0, t], want[s], atol=2e-5, rtol=1e-4)
