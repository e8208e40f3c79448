"""The embedded trainer's step: length-bucketed micro-batches give the one-big-batch update (policy, KL, drafter),
folding the logprob recompute into the train forward gives the separate recompute's update, and padded positions
stay out of the loss even where the processed distribution gives them -inf."""

import copy

import pytest
import torch

import megatron_spec.trainers.embedded as policy_mod
from megatron_spec.drafters.trainer import pack
from megatron_spec.drafters.mtp.model import MTP
from megatron_spec.models import CausalLM, preset
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
from megatron_spec.interfaces import Batch
from megatron_spec.trainers.embedded import EmbeddedPolicy
from megatron_spec.drafters.loss import depth_pairs, pairs_loss
from megatron_spec.drafters.registry import drafter_method

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def tiny_model(name: str = "tiny-qwen3") -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(preset(name))
    model.reset_parameters(std=0.1)
    return model


def rollout_batch(seed: int = 0, rows: int = 16) -> Batch:
    """Prompts of 4-7 tokens and long-tailed completions (most short, a few up to ~40), right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 8, (rows,), generator=g)
    completions = (torch.rand(rows, generator=g) ** 3 * 40).int() + 1
    ends = prompts + completions
    ids = torch.zeros(rows, int(ends.max()), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, n) in enumerate(zip(prompts.tolist(), ends.tolist())):
        ids[i, :n] = torch.randint(3, 64, (n,), generator=g)
        mask[i, p:n] = True
    return Batch(ids, mask, advantages=torch.randn(rows, generator=g))


def make_policy(budget: int, drafter_method: str | None = None, model: str = "tiny-qwen3", move_ref: bool = True,
                drafter_cfg: DrafterTrainSection | None = None, **grpo) -> EmbeddedPolicy:
    target = tiny_model(model)
    drafter = None
    if drafter_method is not None:
        torch.manual_seed(1)
        drafter = {"mtp": lambda: MTP(target.config), "eagle3": lambda: Eagle3Head(target.config),
                   "draft_model": lambda: CausalLM(target.config)}[drafter_method]()
    cfg = GRPOSection(**{"lr": 1e-3, "max_grad_norm": 0.05, "micro_batch_tokens": budget, **grpo})
    policy = EmbeddedPolicy(target, cfg, dict(SAMPLING, top_k=cfg.top_k, top_p=cfg.top_p), drafter, drafter_method,
                            drafter_cfg or DrafterTrainSection())
    if policy.ref is not None and move_ref:  # a reference away from the policy, or the KL and its gradient are 0
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in policy.ref.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return policy


def off_policy(policy: EmbeddedPolicy, batch: Batch, seed: int = 1) -> torch.Tensor:
    """Behaviour log-probs a little away from the policy's, so ratios differ from 1 and the clip is active somewhere."""
    g = torch.Generator().manual_seed(seed)
    return policy.logprobs(batch) + 0.3 * torch.randn(batch.mask.shape[0], batch.mask.shape[1] - 1, generator=g)


def run_step(policy: EmbeddedPolicy, batch: Batch, old: torch.Tensor | None) -> dict:
    batch = copy.copy(batch)
    batch.old_logprobs = None if old is None else old.clone()
    return policy.train_step(batch)


ADAM_EPS = 1e-8
"""torch.optim.AdamW's default eps, which the policy's optimizer keeps."""


def assert_same_update(a: torch.nn.Module, b: torch.nn.Module, lr: float = 1e-3, rel: float = 1e-5) -> None:
    """Same (clipped) gradients to `rel` (1e-5) of each tensor's largest entry: the two paths add the same terms in
    a different order (attention over [prompt | completion] blocks instead of one row, the prompt's gradient summed
    over its rollouts before its backward). Measured on these batches the largest difference is 4-5e-6 of a
    tensor's largest entry (in the embedding's gradient, a sum over every position of a token), the same order as
    cutting the unshared batch into other micro-batches (2-4e-6); the negative controls differ by far more.

    The gradients are the property the two paths share; the weights after AdamW's first step follow from them, but
    not uniformly. That step is lr * g / (|g| + eps) per coordinate, whose sensitivity to g is lr * eps / (|g| +
    eps)^2: where |g| is near eps a last-bit difference in g (which bits differ depends on the CPU's instruction set
    and thread count) moves the weight by a visible part of lr, and where g ~ 0 its sign, and so a 2 lr swing, is
    arbitrary. So the weights are compared tightly only where the step is determined by the gradient: |g| >= 1e3 eps
    and |g| >= 100 x the gradient tolerance d. There the step differs by at most lr * eps * d / |g|^2 <=
    lr * eps / (100 |g|) <= 1e-5 lr, checked at 1e-3 lr (loose against rounding of the weights themselves, ~1e-7
    lr, and tight against any wrong update, which moves a weight by a sizeable part of lr). Everywhere else AdamW's
    first step is at most lr in size, so the weights differ by at most 2 lr: checked too, as a bound that still
    catches an update applied twice or to the wrong tensor."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is None:
            torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=lambda m: f"{name} (no gradient) changed: {m}")
            continue
        tol = rel * float(pa.grad.abs().max())
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=tol, msg=lambda m: f"grad of {name}: {m}")
        determined = pa.grad.abs() >= max(1e3 * ADAM_EPS, 100 * tol)
        torch.testing.assert_close(pa[determined], pb[determined], rtol=0, atol=1e-3 * lr,
                                   msg=lambda m: f"{name} after the update, where |g| >> eps: {m}")
        torch.testing.assert_close(pa, pb, rtol=0, atol=2 * lr * (1 + 1e-3),
                                   msg=lambda m: f"{name} after the update: {m}")


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_bucketed_update_equals_one_big_batch(loss_agg, monkeypatch):
    """Budget 0 (one batch padded to the longest row) against a budget that cuts the batch into several buckets,
    KL on: same loss, KL, clip fraction, gradients and updated weights (fp32, up to summation order). The negative
    control drops the whole-batch denominators (each bucket a mean of its own): the same check then fails, so the
    comparison is tight enough to see a wrong normalisation."""
    batch = rollout_batch()
    one, bucketed = make_policy(0, loss_agg=loss_agg, kl_coef=0.1), make_policy(160, loss_agg=loss_agg, kl_coef=0.1)
    old = off_policy(one, batch)
    assert len(bucketed.split(batch)) >= 3 and len(one.split(batch)) == 1
    ma, mb = run_step(one, batch, old), run_step(bucketed, batch, old)
    for key in ("loss", "kl", "clip_frac"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    assert 0 < ma["clip_frac"] < 1 and ma["kl"] > 0 and not mb["skipped"]
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5) and ma["grad_norm"] > 0.05  # clip active
    assert_same_update(one.model, bucketed.model)
    moved = tiny_model()
    assert any(not torch.allclose(p, q) for p, q in zip(moved.parameters(), bucketed.model.parameters()))

    real_loss, real_aggregate = policy_mod.policy_loss, policy_mod.aggregate
    monkeypatch.setattr(policy_mod, "policy_loss", lambda *a, **k: real_loss(*a[:7]))
    monkeypatch.setattr(policy_mod, "aggregate", lambda *a, **k: real_aggregate(*a[:3]))
    wrong = make_policy(160, loss_agg=loss_agg, kl_coef=0.1)
    run_step(wrong, batch, old)
    with pytest.raises(AssertionError):
        assert_same_update(one.model, wrong.model)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "draft_model"])
def test_bucketed_drafter_update_equals_one_big_batch(method):
    """Online drafter training per bucket, each bucket's loss weighted by its share of the generated tokens: the
    drafter's gradient, loss and weights equal the one-big-batch drafter update (prompts here are >= 4 tokens)."""
    batch = rollout_batch(seed=2)
    one, bucketed = make_policy(0, method), make_policy(160, method)
    old = off_policy(one, batch)
    ma, mb = run_step(one, batch, old), run_step(bucketed, batch, old)
    assert mb["drafter_loss"] == pytest.approx(ma["drafter_loss"], rel=1e-5)
    assert_same_update(one.model, bucketed.model)
    assert_same_update(one.drafter, bucketed.drafter)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bucketed.drafter.parameters())


def test_several_drafter_updates_are_passes_over_the_same_detached_states():
    """`drafter_train.updates=3` equals one update followed by two more passes over the same micro-batches' detached
    states, bit for bit (same ops, same order, the AdamW state carried on); the loss and agreement reported are
    the first pass's. The negative control: one update alone leaves other weights."""
    batch = rollout_batch(seed=2)
    three, one = make_policy(160, "mtp", drafter_cfg=DrafterTrainSection(updates=3)), make_policy(160, "mtp")
    seen = {}
    real = one.drafter_trainer.step
    one.drafter_trainer.step = lambda target, forwards, tokens, *rest: (seen.update(forwards=forwards, tokens=tokens)
                                                                        or real(target, forwards, tokens))
    old = off_policy(one, batch)
    m3, m1 = run_step(three, batch, old), run_step(one, batch, old)
    assert m3["drafter_loss"] == m1["drafter_loss"] and m3["drafter_agreement"] == m1["drafter_agreement"]
    assert any(not torch.equal(a, b) for a, b in zip(three.drafter.parameters(), one.drafter.parameters()))
    for _ in range(2):
        one.drafter_trainer.run_pass(one.model, seen["forwards"], seen["tokens"], learn=True, measure=False)
    for (name, a), b in zip(three.drafter.named_parameters(), one.drafter.parameters()):
        assert torch.equal(a, b), name


def test_replayed_drafter_updates_are_earlier_steps_then_this_one():
    """`drafter_train.replay=2`: step 1 trains on its batch as without replay; step 2 first measures the drafter
    that drafted its batch (no gradient), then one optimizer step on step 1's detached states and one on step 2's,
    bit for bit. Checked against a policy without replay whose second drafter step does exactly that by hand; the
    negative control is that policy's own second step (its batch only), which leaves other weights."""
    b1, b2 = rollout_batch(seed=2), rollout_batch(seed=4)
    rep = make_policy(160, "mtp", drafter_cfg=DrafterTrainSection(replay=2))
    ref, plain = make_policy(160, "mtp"), make_policy(160, "mtp")
    seen = []
    real = ref.drafter_trainer.step

    def by_hand(target, forwards, tokens, deadline=None):
        seen.append((forwards, tokens))
        if len(seen) == 1:
            return real(target, forwards, tokens)
        loss, agree = ref.drafter_trainer.run_pass(target, forwards, tokens, learn=False, measure=True)
        for f, t in seen:
            ref.drafter_trainer.run_pass(target, f, t, learn=True, measure=False)
        return {"drafter_loss": loss, "drafter_agreement": agree}

    ref.drafter_trainer.step = by_hand
    for batch, seed in ((b1, 1), (b2, 3)):
        old = off_policy(rep, batch, seed)
        m_rep, m_ref, m_plain = run_step(rep, batch, old), run_step(ref, batch, old), run_step(plain, batch, old)
        assert m_rep["drafter_loss"] == m_ref["drafter_loss"] == m_plain["drafter_loss"]
        assert m_rep["drafter_agreement"] == m_ref["drafter_agreement"]
    for (name, a), b in zip(rep.drafter.named_parameters(), ref.drafter.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(rep.drafter.parameters(), plain.drafter.parameters()))


def test_drafter_minibatches_deal_the_rows_and_step_on_each():
    """`drafter_train.minibatches=3`: the batch's rows are dealt into 3 minibatches (row i of each micro-batch to
    minibatch i mod 3) that together hold every generated token once, and the drafter takes one optimizer step on
    each, each weighted by its own tokens, after measuring the drafter that drafted the batch; bit for bit against
    the same done by hand. The negative control: the one-step update leaves other weights."""
    batch = rollout_batch(seed=2)
    three = make_policy(160, "mtp", drafter_cfg=DrafterTrainSection(minibatches=3))
    ref, plain = make_policy(160, "mtp"), make_policy(160, "mtp")

    def by_hand(target, forwards, tokens, deadline=None):
        parts = [[f.rows(slice(j, None, 3)) for f in forwards] for j in range(3)]
        rows = [sum(p.input_ids.shape[0] for p in part) for part in parts]
        assert sum(rows) == batch.input_ids.shape[0] and max(rows) - min(rows) <= len(forwards)
        counts = [float(sum(p.mask.sum() for p in part)) for part in parts]
        assert sum(counts) == tokens == float(batch.mask.sum())
        measured = ref.drafter_trainer.run_pass(target, forwards, tokens, learn=False, measure=True)
        packed = [pack(part, 160) for part in parts]  # the policy's micro_batch_tokens
        assert sum(map(len, packed)) < sum(map(len, parts))  # some minibatch's rows were joined
        for part, count in zip(packed, counts):
            ref.drafter_trainer.run_pass(target, part, count, learn=True, measure=False)
        return {"drafter_loss": measured[0], "drafter_agreement": measured[1]}

    ref.drafter_trainer.step = by_hand
    old = off_policy(three, batch)
    m3, mr, mp = run_step(three, batch, old), run_step(ref, batch, old), run_step(plain, batch, old)
    assert m3["drafter_loss"] == mr["drafter_loss"] == mp["drafter_loss"]
    assert m3["drafter_agreement"] == mr["drafter_agreement"] == mp["drafter_agreement"]
    for (name, a), b in zip(three.drafter.named_parameters(), ref.drafter.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(three.drafter.parameters(), plain.drafter.parameters()))


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_joined_rows_keep_their_own_drafter_predictions(method):
    """`pack` joins rows of micro-batches of different lengths, right-padded. Each row's drafter logits at every
    draft depth, and the target's beside them, equal those of its own micro-batch within 1e-5 (fp32: only the
    order a batched matmul sums in may differ, ~1e-7 relative per op through one drafter layer and the head; a
    row shifted or attending to padding moves them by far more), the joined mask holds exactly the parts'
    generated tokens, and the token-weighted loss is the parts' within 1e-6. Packing keeps to its budget."""
    policy, seen = make_policy(160, method), {}
    real = policy.drafter_trainer.step
    policy.drafter_trainer.step = lambda target, forwards, tokens, *rest: (seen.update(forwards=forwards)
                                                                           or real(target, forwards, tokens))
    run_step(policy, rollout_batch(seed=2), None)
    parts = [f.rows(slice(0, None, 2)) for f in seen["forwards"]]
    assert len({p.input_ids.shape[1] for p in parts}) > 1  # lengths differ, so rows are padded
    (joined,) = pack(parts, 0)
    assert int(joined.mask.sum()) == sum(int(p.mask.sum()) for p in parts)

    def pairs(f):
        with torch.no_grad():
            return depth_pairs(drafter_method(method).online_loss, policy.model, policy.drafter, f.input_ids, f.mask,
                               f.out, f.logits)

    together, row, tokens = pairs(joined), 0, float(joined.mask.sum())
    weighted = 0.0
    for p in parts:
        alone, b = pairs(p), p.input_ids.shape[0]
        weighted += float(p.mask.sum()) / tokens * float(pairs_loss(policy.drafter, alone))
        for a, t in zip(alone, together):
            n = a.student.shape[1]
            torch.testing.assert_close(t.student[row : row + b, :n], a.student, rtol=0, atol=1e-5)
            assert torch.equal(t.teacher[row : row + b, :n], a.teacher) and torch.equal(t.mask[row : row + b, :n], a.mask)
            assert not t.mask[row : row + b, n:].any()
        row += b
    assert float(pairs_loss(policy.drafter, together)) == pytest.approx(weighted, abs=1e-6)
    for budget in range(1, 400, 20):
        for batch in pack(parts, budget) + pack(parts[::-1], budget):
            b, t = batch.input_ids.shape
            assert b * t <= budget or any(batch is p for p in parts)  # only a part alone may exceed it


@pytest.mark.parametrize("budget", [0, 160])
def test_folded_logprobs_give_exactly_the_recompute_update(budget):
    """One update per step: the train forward's own detached log-probs are the recompute's, bit for bit, so the
    loss and the updated weights are identical; the folded log-probs come back in `batch.old_logprobs`."""
    batch = rollout_batch(seed=3)
    sep, fold = make_policy(budget, kl_coef=0.1), make_policy(budget, kl_coef=0.1)
    recomputed = sep.logprobs(batch)
    folded = copy.copy(batch)
    m_sep, m_fold = run_step(sep, batch, recomputed), fold.train_step(folded)
    assert m_fold["loss"] == m_sep["loss"] and m_fold["kl"] == m_sep["kl"]
    assert torch.equal(folded.old_logprobs, recomputed)
    for (name, a), b in zip(sep.model.named_parameters(), fold.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("processing", [dict(top_k=5), dict(top_p=0.5)])
def test_padding_outside_top_k_or_top_p_keeps_the_loss_finite(processing):
    """A padding token outside the top-k / top-p set has log-prob -inf under the policy and the reference alike;
    -inf - (-inf) at a zero-weight position used to make every such step's loss NaN (and skip its update)."""
    policy = make_policy(160, kl_coef=0.1, move_ref=False, **processing)  # ref's top-k set = the policy's
    batch = rollout_batch(seed=4)
    with torch.no_grad():  # greedy completions: every generated token lies inside the top-k / top-p set
        for t in range(1, batch.mask.shape[1]):
            greedy = policy.model(batch.input_ids[:, :t])[:, -1].argmax(-1)
            batch.input_ids[:, t] = torch.where(batch.mask[:, t], greedy, batch.input_ids[:, t])
    metrics = run_step(policy, batch, None)
    assert not metrics["skipped"] and torch.isfinite(torch.tensor([metrics["loss"], metrics["kl"]])).all()
    assert all(torch.isfinite(p.grad).all() for p in policy.model.parameters() if p.grad is not None)


def test_moe_router_loss_is_taken_per_bucket():
    """MoE: the load-balancing loss joins each bucket's loss; with one bucket the step is the one-big-batch step."""
    batch = rollout_batch(seed=5, rows=8)
    metrics = run_step(make_policy(160, model="tiny-qwen3-moe"), batch, None)
    assert not metrics["skipped"] and metrics["loss"] > 0  # on-policy A-weighted loss + aux (~coef * 1)
