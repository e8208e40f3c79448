"""Prompt sharing in the trainer (megatron_spec/rl/prefix.py): each GRPO group's prompt goes through the trunk once
per step and its completions attend to its keys/values. The update (policy, KL, folded log-probs, online drafters)
equals the unshared one up to fp32 summation order, fewer positions are computed, and the comparison is tight
enough to catch a mask that shows one position too many or a prefix gradient that never reaches the weights."""

import copy

import pytest
import torch

import megatron_spec.rl.prefix as prefix_mod
from megatron_spec.interfaces import Batch
from megatron_spec.trainers.embedded import EmbeddedPolicy
from megatron_spec.rl.prefix import prompt_groups
from tests.rl.test_policy import assert_same_update, make_policy, off_policy, rollout_batch, run_step

PROMPT_LENS = (5, 8, 11)
GROUP = 4


def group_batch(seed: int = 0, max_completion: int = 30) -> Batch:
    """3 groups x 4 rollouts: one random prompt per group (5, 8 and 11 tokens), a long-tailed completion per rollout
    (1..30 tokens), rows shuffled so that groups can only be found by content."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in PROMPT_LENS:
        prompt = torch.randint(3, 64, (p,), generator=g)
        for _ in range(GROUP):
            n = int(torch.rand((), generator=g) ** 2 * max_completion) + 1
            rows.append((prompt, torch.randint(3, 64, (n,), generator=g)))
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    T = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p)], ids[i, len(p) : len(p) + len(c)] = p, c
        mask[i, len(p) : len(p) + len(c)] = True
    return Batch(ids, mask, advantages=torch.randn(len(rows), generator=g))


def pair(budget: int, drafter: str | None = None, **grpo) -> tuple[EmbeddedPolicy, EmbeddedPolicy]:
    """The same policy (same initial weights, reference and drafter) without and with prompt sharing."""
    return (make_policy(budget, drafter, share_prompt=False, **grpo),
            make_policy(budget, drafter, share_prompt=True, **grpo))


def test_groups_are_found_by_content():
    batch = group_batch()
    groups = prompt_groups(batch.input_ids, batch.mask)
    assert len(groups.first_row) == len(PROMPT_LENS) and groups.repeated
    for r, (p, g) in enumerate(zip(groups.prompt_len, groups.group)):
        first = groups.first_row[g]
        assert p == groups.prompt_len[first] and torch.equal(batch.input_ids[r, :p], batch.input_ids[first, :p])
    assert sorted(groups.prompt_len) == sorted(p for p in PROMPT_LENS for _ in range(GROUP))


@pytest.mark.parametrize("budget", [0, 48])
@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_shared_update_equals_unshared(loss_agg, budget):
    """KL on, off-policy behaviour log-probs (the clip is active somewhere), one batch (budget 0) or several
    micro-batches (48: the prompts' states then collect gradient from several backward passes before the one
    through the prefix pass): same loss, KL, clip fraction, gradients and updated weights."""
    batch = group_batch()
    plain, shared = pair(budget, loss_agg=loss_agg, kl_coef=0.1)
    if budget:
        assert len(shared.split(batch)) >= 3
    old = off_policy(plain, batch)
    ma, mb = run_step(plain, batch, old), run_step(shared, batch, old)
    for key in ("loss", "kl", "clip_frac"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    assert 0 < ma["clip_frac"] < 1 and ma["kl"] > 0 and not mb["skipped"]
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)
    assert_same_update(plain.model, shared.model)


@pytest.mark.parametrize("budget", [0, 48])
def test_folded_and_recomputed_logprobs_equal_unshared(budget):
    """Folded: the train forward's own log-probs (written back into `batch.old_logprobs`) equal the unshared ones to
    fp32 summation order (default float32 tolerances: rtol 1.3e-6, atol 1e-5 on log-probs of order -4), and the
    update equals the unshared one. Shared `logprobs()` (the separate recompute) goes through the same prefix pass
    and micro-batches as the train forward, so it gives the folded numbers bit for bit."""
    batch = group_batch(seed=1)
    plain, shared = pair(budget, kl_coef=0.1)
    recomputed = shared.logprobs(batch)
    torch.testing.assert_close(recomputed, plain.logprobs(batch))
    a, b = copy.copy(batch), copy.copy(batch)
    plain.train_step(a)
    shared.train_step(b)
    torch.testing.assert_close(b.old_logprobs, a.old_logprobs)
    assert torch.equal(b.old_logprobs, recomputed)
    assert_same_update(plain.model, shared.model)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "draft_model"])
def test_online_drafter_update_equals_unshared(method):
    """The drafters read the re-assembled [b, T] hidden states, captured layers (EAGLE-3) and logits: same drafter
    loss, gradients and weights as unshared. The drafter's gradients are compared to 5e-5 of each tensor's largest
    entry: its update runs after the policy's and reads the updated embedding (EAGLE-3, MTP) or output head (MTP),
    whose near-zero-gradient coordinates took AdamW steps that differ by up to ~1 % of lr between the two runs (well
    inside what `assert_same_update` allows the weights); measured, that puts EAGLE-3's largest drafter-gradient
    difference at 1e-5 (2e-6 with the same trunk weights: the states' own rounding), MTP's at 4e-6."""
    batch = group_batch(seed=2)
    plain, shared = pair(48, method)
    old = off_policy(plain, batch)
    ma, mb = run_step(plain, batch, old), run_step(shared, batch, old)
    assert mb["drafter_loss"] == pytest.approx(ma["drafter_loss"], rel=1e-5)
    assert_same_update(plain.model, shared.model)
    assert_same_update(plain.drafter, shared.drafter, rel=5e-5)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.drafter.parameters())


def test_a_wrong_mask_or_a_missing_prefix_backward_is_caught(monkeypatch):
    """Negative controls for the equality check above: (1) every row sees one more prefix position (the first
    padding position of its group's prompt block), (2) the prompts' accumulated gradient never goes through the
    prefix pass. Either makes the gradients differ beyond the tolerance."""
    batch = group_batch()
    plain = make_policy(0, share_prompt=False, kl_coef=0.1)
    old = off_policy(plain, batch)
    run_step(plain, batch, old)

    real_mask = prefix_mod.prefix_mask
    with monkeypatch.context() as m:
        m.setattr(prefix_mod, "prefix_mask", lambda p, width, suffix: real_mask(p + 1, width, suffix))
        peeking = make_policy(0, share_prompt=True, kl_coef=0.1)
        run_step(peeking, batch, old)
    with pytest.raises(AssertionError, match="grad of"):
        assert_same_update(plain.model, peeking.model)

    with monkeypatch.context() as m:
        m.setattr(prefix_mod.SharedPrompts, "backward", lambda self: None)
        cut = make_policy(0, share_prompt=True, kl_coef=0.1)
        run_step(cut, batch, old)
    with pytest.raises(AssertionError, match="grad of"):
        assert_same_update(plain.model, cut.model)


def count_positions(policy: EmbeddedPolicy) -> dict:
    """Forward hooks counting the positions the first decoder layer computes (padding included: the real cost) and
    the non-padding token ids the embedding reads (padding is id 0 here)."""
    counts = {"positions": 0, "tokens": 0}

    def layer_hook(module, args):
        counts["positions"] += args[0].shape[0] * args[0].shape[1]

    def embed_hook(module, args):
        counts["tokens"] += int((args[0] != 0).sum())

    policy.model.model.layers[0].register_forward_pre_hook(layer_hook)
    policy.model.model.embed_tokens.register_forward_pre_hook(embed_hook)
    return counts


def test_shared_forward_computes_each_prompt_once():
    """One train step, budget 0: unshared, the trunk reads every row's prompt and completion (B x T positions);
    shared, each distinct prompt once (3 x 11 positions, 5 + 8 + 11 tokens) plus every row's completion (B x its
    longest completion). Both sides' counts are spelled out from the batch, so a pass that still repeats a prompt
    (or skips one) fails."""
    batch = group_batch()
    plain, shared = pair(0)
    counts = count_positions(plain), count_positions(shared)
    run_step(plain, batch, None)
    run_step(shared, batch, None)
    B, T = batch.mask.shape
    completion = batch.mask.sum(1)
    assert counts[0] == {"positions": B * T, "tokens": GROUP * sum(PROMPT_LENS) + int(completion.sum())}
    assert counts[1] == {"positions": len(PROMPT_LENS) * max(PROMPT_LENS) + B * int(completion.max()),
                         "tokens": sum(PROMPT_LENS) + int(completion.sum())}
    assert counts[1]["positions"] < counts[0]["positions"]


def test_sharing_is_skipped_for_moe_and_without_repeated_prompts():
    """MoE: the load-balancing loss counts routed tokens, so sharing (which routes a prompt once) is off. A batch
    whose prompts are all distinct has nothing to share and takes the unshared path."""
    batch = group_batch()
    assert make_policy(0, model="tiny-qwen3-moe").share(batch) is None
    assert make_policy(0).share(batch) is not None
    assert make_policy(0).share(rollout_batch(rows=8)) is None
