"""Rollout correction (`grpo.rollout_correction`) and bounded staleness (`grpo.max_trajectory_age`).

Each mode of the pure functions is compared with a reference written differently: Python loops over rows and
tokens in float64 (`math.prod` of the token ratios, their n-th root), on crafted ratios with padding that holds
garbage, a row without any generated token, and ratios on both sides of every bound. The functions run in float32
as the trainers run them: exp of a log-ratio of at most |log 5| rounds to within 2 ulp (~2.4e-7 relative), so 1e-6
relative holds on any instruction set; no crafted ratio lies within 1e-3 of a bound, so no comparison can flip.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_spec.interfaces import Rollouts
from megatron_spec.rl.config import GRPOSection, RLConfig, RolloutCorrection
from megatron_spec.rl.grpo import (LossNorm, correction_stats, log_is_ratios, policy_loss, rejection_mask,
                                   truncated_is_weights)
from megatron_spec.rl.loop import StageTimer, Trainer, config_problems, fresh_groups, step_advantages

RATIOS = [[3.0, 0.5, 1.2, None],
          [0.1, 0.9, None, None],
          [None, None, None, None],  # no generated token
          [1.5, 1.5, 1.5, 1.5],
          [0.2, 5.0, 1.0, 1.0]]
"""pi_old / mu per generated token (None: padding)."""


def crafted():
    """(old, behaviour, mask) [5, 4] float32 whose ratios are RATIOS; padding carries behaviour log-probs of 40."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 4, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[r is not None for r in row] for row in RATIOS])
    log_r = torch.tensor([[math.log(r) if r is not None else 0.0 for r in row] for row in RATIOS], dtype=torch.float64)
    behaviour = torch.where(mask, old - log_r, 40.0)
    return old.float(), behaviour.float(), mask


def reference_ratio(row: list, level: str) -> list:
    """Per position of one row, the ratio that weighs it at `level` (None at padding), by loops in float64."""
    tokens = [r for r in row if r is not None]
    if level == "sequence":
        whole = math.prod(tokens)
    elif level == "geometric":
        whole = math.prod(tokens) ** (1 / len(tokens)) if tokens else 1.0
    return [None if r is None else (r if level == "token" else whole) for r in row]


LEVELS = ["token", "sequence", "geometric"]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("clip", [None, 2.0])
def test_weights_equal_the_reference(level, clip):
    old, behaviour, mask = crafted()
    weights, truncated = truncated_is_weights(old, behaviour, clip, mask, level)
    for i, row in enumerate(RATIOS):
        for t, r in enumerate(reference_ratio(row, level)):
            if r is None:
                assert not truncated[i, t]
                continue
            want = r if clip is None else min(r, clip)
            assert float(weights[i, t]) == pytest.approx(want, rel=1e-6), (i, t)
            assert bool(truncated[i, t]) == (clip is not None and r > clip), (i, t)
    # level decides how much is truncated: 2 tokens (3, 5); rows 0 (1.8) and 3 (5.06) at `sequence`; row 3 (1.5)
    # nowhere at `geometric` (0: 1.19, 1: 0.30, 4: 1.0)
    if clip is not None:
        assert int(truncated.sum()) == {"token": 2, "sequence": 4, "geometric": 0}[level]


def test_a_sequence_product_beyond_float32_truncates_to_the_bound():
    """200 tokens at ratio 2: the product 2^200 overflows float32, the log-space truncation still gives the bound."""
    old = torch.zeros(1, 200)
    weights, truncated = truncated_is_weights(old, old - math.log(2), 2.0, torch.ones(1, 200, dtype=torch.bool),
                                              "sequence")
    assert torch.equal(weights, torch.full((1, 200), 2.0)) and truncated.all()


BANDS = [(0.5, 2.0), (None, 2.0), (0.5, None)]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("low, high", BANDS)
def test_rejection_equals_the_reference(level, low, high):
    old, behaviour, mask = crafted()
    kept = rejection_mask(old, behaviour, mask, level, low, high)
    want = [[r is not None and (low is None or r >= low) and (high is None or r <= high)
             for r in reference_ratio(row, level)] for row in RATIOS]
    assert kept.tolist() == want
    if level != "token":  # whole rows: a row is kept entirely or not at all
        assert all(kept[i].sum() in (0, mask[i].sum()) for i in range(len(RATIOS)))


def test_the_rejected_tokens_leave_the_means():
    """The loss over the kept mask, with its own norm, at ratio 1 (policy = old): the token mean is the sum of
    -w A over the kept tokens divided by their count, and the sequence mean averages only the rows that kept a token
    (a row wholly rejected is out of the denominator, as `LossNorm` counts rows with a token); by loops."""
    old, behaviour, mask = crafted()
    advantages = torch.tensor([1.0, -2.0, 0.7, 0.5, 3.0])
    kept = rejection_mask(old, behaviour, mask, "geometric", 0.5, 2.0)  # row 1 (0.30) out; 0, 3, 4 stay
    weights, _ = truncated_is_weights(old, behaviour, 2.0, kept, "geometric")
    for agg in ("token", "sequence"):
        loss, _ = policy_loss(old, old, advantages, kept, agg=agg, norm=LossNorm.of(kept), is_weights=weights)
        per_row = {}
        for i, row in enumerate(RATIOS):
            w = reference_ratio(row, "geometric")[0]
            terms = [-min(w, 2.0) * float(advantages[i]) for t, r in enumerate(row) if kept[i, t]]
            if terms:
                per_row[i] = terms
        assert sorted(per_row) == [0, 3, 4]
        if agg == "token":
            want = sum(sum(v) for v in per_row.values()) / sum(len(v) for v in per_row.values())
        else:
            want = sum(sum(v) / len(v) for v in per_row.values()) / len(per_row)
        assert float(loss) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_stats_equal_the_reference(level):
    old, behaviour, mask = crafted()
    kept = rejection_mask(old, behaviour, mask, level, 0.5, 2.0)
    stats = correction_stats(old, behaviour, mask, kept, level)
    if level == "token":
        ratios = [r for row in RATIOS for r in row if r is not None]
    else:  # one per row with a generated token
        ratios = [reference_ratio(row, level)[0] for row in RATIOS if any(r is not None for r in row)]
    assert stats["is_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert stats["is_ratio_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert stats["is_ratio_min"] == pytest.approx(min(ratios), rel=1e-6)
    generated = sum(r is not None for row in RATIOS for r in row)
    assert stats["is_masked_tokens_frac"] == (int(mask.sum()) - int(kept.sum())) / generated
    # rows with a token that rejection emptied, of the 4 rows with a token: none at `token` (row 1 keeps its 0.9),
    # row 1 at `geometric` (0.30), rows 1 (0.09) and 3 (5.06) at `sequence` (row 4's product is 1.0)
    assert stats["is_masked_seqs_frac"] == {"token": 0, "sequence": 2, "geometric": 1}[level] / 4


def test_log_ratios_are_zero_outside_the_mask_and_the_level_is_checked():
    old, behaviour, mask = crafted()
    for level in LEVELS:
        assert log_is_ratios(old, behaviour, mask, level)[~mask].eq(0).all()
    with pytest.raises(ValueError, match="unknown importance ratio level 'row'"):
        log_is_ratios(old, behaviour, mask, "row")


# -- the trainers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_the_embedded_trainer_weighs_each_row_by_its_level(level):
    """The embedded trainer, micro-batched (budget 64: several micro-batches, each with whole rows) with behaviour
    log-probs 0.4 x N(0, 1) below / above its old ones, and 0.8 more below on every fourth row (so some rows'
    geometric means pass the bound too): at ratio 1 (old = its own log-probs) each token's surrogate
    is -w A, so the loss is the reference weights' token mean and `is_clip_frac` the truncated share of the tokens.
    1e-5: the trainer's log-probs equal the probe's up to fp32 rounding of the forward (ratios within ~1e-6 of 1)."""
    from tests.rl.test_policy import make_policy, rollout_batch

    batch = rollout_batch()
    old = make_policy(0).logprobs(batch)
    mask = batch.mask[:, 1:]
    log_r = 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    log_r[::4] += 0.8
    policy = make_policy(64, rollout_correction=RolloutCorrection(level=level, truncate=2.0))
    b = copy.copy(batch)
    b.old_logprobs, b.behaviour_logprobs = old.clone(), old - log_r
    metrics = policy.train_step(b)
    ratios = [[math.exp(float(log_r[i, t])) if mask[i, t] else None for t in range(mask.shape[1])]
              for i in range(mask.shape[0])]
    total = count = truncated = 0
    for i, row in enumerate(ratios):
        for r in reference_ratio(row, level):
            if r is not None:
                total += -min(r, 2.0) * float(batch.advantages[i])
                count += 1
                truncated += r > 2.0
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    assert metrics["is_clip_frac"] == pytest.approx(truncated / count, abs=1e-7)
    assert truncated > 0  # the truncation is exercised at every level


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_the_embedded_trainer_leaves_rejected_rows_out(agg):
    """Sequences rejected whole keep their rows with an empty mask (the loop narrows the batch's mask): the embedded
    trainer's update (geometric ratios; each aggregation, so the sequence mean's row count is checked too) equals
    its update on the batch without those rows: the loss to 3e-6 absolute (a mean of 13-16 terms of size <= 3
    summed in another order, the micro-batches being cut otherwise: n x fp32 eps x 3 bounds the difference; the
    terms cancel to ~0.05, so this is not a relative bound; observed 3e-7; three empty rows counted in the sequence
    mean would move it by ~1e-2), and the weights to
    within Adam's worst case for an element whose tiny gradient rounds differently (2 x lr, lr 1e-3) with a mean
    below 1e-7 (a row that still counted would move most weights by ~lr)."""
    from tests.rl.test_policy import make_policy, rollout_batch

    batch = rollout_batch()
    old = make_policy(0).logprobs(batch)
    rejected = torch.zeros(batch.mask.shape[0], dtype=torch.bool)
    rejected[[1, 4, 9]] = True
    kept_rows = (~rejected).nonzero().flatten()
    results = []
    for b in (copy.copy(batch), batch.select(kept_rows.tolist(), batch.mask.shape[1])):
        if b.mask.shape[0] == batch.mask.shape[0]:
            b.mask = batch.mask & ~rejected[:, None]
            b.old_logprobs = old.clone()
        else:
            b.old_logprobs = old[kept_rows].clone()
        b.behaviour_logprobs = b.old_logprobs - 0.3
        policy = make_policy(64, loss_agg=agg, rollout_correction=RolloutCorrection(level="geometric"))
        metrics = policy.train_step(b)
        results.append((metrics, [p.detach().clone() for p in policy.model.parameters()]))
    (a, wa), (b, wb) = results
    assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=3e-6) and a["is_clip_frac"] == b["is_clip_frac"] == 0.0
    assert abs(a["loss"]) > 1e-3
    diffs = torch.cat([(x - y).abs().flatten() for x, y in zip(wa, wb)])
    assert diffs.max() <= 2e-3 and diffs.mean() <= 1e-7


def test_micro_batches_left_without_a_token_give_the_drafter_nothing_to_learn():
    """Rows whose every token left the update sit together where the length buckets put them (here every row of
    at most 4 generated tokens, several micro-batches of 16 tokens): the online MTP drafter's loss is then its loss
    on the batch without those rows, to 1e-5 relative (fp32 sums in another order); a batch with no token left at
    all changes no weight (zero gradients into a fresh AdamW) and reports zero losses."""
    from tests.rl.test_policy import make_policy, rollout_batch

    batch = rollout_batch()
    mask = batch.mask
    short = mask.sum(1) <= 4
    assert 4 <= int(short.sum()) < len(short)
    results = []
    for b in (copy.copy(batch), batch.select((~short).nonzero().flatten().tolist(), mask.shape[1])):
        if b.mask.shape[0] == mask.shape[0]:
            b.mask = mask & ~short[:, None]
        results.append(make_policy(16, "mtp").train_step(b))
    assert results[0]["drafter_loss"] == pytest.approx(results[1]["drafter_loss"], rel=1e-5)
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=0, abs=3e-6)
    policy = make_policy(16, "mtp")
    before = [p.detach().clone() for p in [*policy.model.parameters(), *policy.drafter.parameters()]]
    empty = copy.copy(batch)
    empty.mask = torch.zeros_like(mask)
    metrics = policy.train_step(empty)
    assert metrics["loss"] == 0.0 and metrics["drafter_loss"] == 0.0
    after = [*policy.model.parameters(), *policy.drafter.parameters()]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


class RecordingPolicy:
    """A trainer that keeps the batch it is given and returns the old log-probs a crafted step needs."""

    def __init__(self, old):
        self.old, self.batch = old, None

    def logprobs(self, batch):
        return self.old[: batch.mask.shape[0], : batch.mask.shape[1] - 1].clone()

    def train_step(self, batch):
        self.batch = copy.copy(batch)
        return {"loss": 0.0}


def learn(trainer_kind: str, ages: list[int], ratios: list[float], rewards=(1.0, 0.0, 1.0, 0.0, 0.0, 1.0), **grpo):
    """`Trainer.learn` on 3 groups of 2 one-token rollouts (prompt [1]) whose ratio old / behaviour is `ratios`,
    generated a policy version ago (lag 1), with a recording trainer. Returns (the batch it trained, metrics)."""
    trainer = object.__new__(Trainer)
    trainer.cfg = RLConfig()
    trainer.cfg.backend.trainer = trainer_kind
    trainer.cfg.grpo = GRPOSection(group_size=2, prompts_per_step=3, fold_logprob=False, **grpo)
    old = torch.full((6, 1), -1.0)
    trainer.policy = RecordingPolicy(old)
    outs = [SimpleNamespace(token_ids=[5], logprobs=[-1.0 - math.log(r)]) for r in ratios]
    rewards = torch.tensor(rewards)
    train, mismatch = trainer.learn([[1]] * 6, Rollouts(outs, lag=1, ages=ages), rewards, StageTimer())
    assert mismatch is None
    return trainer.policy.batch, train


@pytest.mark.parametrize("trainer_kind", ["embedded", "megatron"])
def test_learn_drops_stale_groups_and_rejects_out_of_band_tokens(trainer_kind):
    """Group 1 is 3 versions old with a bound of 2: the embedded trainer gets the 4 other rows, the Megatron trainer
    (a fixed row count) all 6 with group 1's emptied and advantage 0; the token at ratio 3 (row 0) leaves the mask
    as out of [0.5, 2]; the stats are those of the rows left after the staleness filter (tokens 3, 1, 1, 1)."""
    batch, train = learn(trainer_kind, [1, 1, 3, 3, 0, 0], [3.0, 1.0, 1.0, 1.0, 1.0, 1.0], max_trajectory_age=2,
                         rollout_correction=RolloutCorrection(reject_low=0.5, reject_high=2.0))
    assert train["groups_dropped_stale"] == 1 and "groups_dropped" not in train
    rows = batch.mask[:, 1:].flatten().tolist()
    if trainer_kind == "embedded":
        assert rows == [False, True, True, True]
        assert batch.advantages.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # std + 1e-6
    else:
        assert rows == [False, True, False, False, True, True]
        assert batch.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, -1.0, 1.0], abs=1e-5)
    assert batch.behaviour_logprobs is not None
    assert train["is_ratio_max"] == pytest.approx(3.0) and train["is_ratio_min"] == pytest.approx(1.0)
    assert train["is_ratio_mean"] == pytest.approx(1.5)
    assert train["is_masked_tokens_frac"] == 0.25 and train["is_masked_seqs_frac"] == 0.25


def test_dynamic_sampling_keeps_the_megatron_trainers_rows():
    """`drop_uniform_groups` with the Megatron trainer: the uniform group 1 keeps its rows, with an empty mask and
    advantage 0 (`leave_out_rows`, whose update equals the one without the rows: tests/trainers/megatron's
    `test_corrected_step_with_left_out_rows_equals_the_embedded_step_without_them`); the embedded trainer gets
    the 4 other rows."""
    rewards = (1.0, 0.0, 1.0, 1.0, 0.0, 1.0)
    batch, train = learn("megatron", [0] * 6, [1.0] * 6, rewards, drop_uniform_groups=True)
    assert train["groups_dropped"] == 1 and "groups_dropped_stale" not in train
    assert batch.mask[:, 1:].flatten().tolist() == [True, True, False, False, True, True]
    assert batch.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, -1.0, 1.0], abs=1e-5)
    batch, _ = learn("embedded", [0] * 6, [1.0] * 6, rewards, drop_uniform_groups=True)
    assert batch.mask.shape[0] == 4 and batch.mask[:, 1:].all()


def test_every_group_stale_leaves_an_update_without_any_token():
    """No fresh group: the rows stay (there is no batch without rows), none with a generated token."""
    batch, train = learn("embedded", [5] * 6, [1.0] * 6, max_trajectory_age=2)
    assert train["groups_dropped_stale"] == 3 and not batch.mask.any() and batch.advantages.eq(0).all()


def test_stale_groups_go_before_dynamic_sampling_chooses():
    """Groups 0 and 1 differ in reward, 2 and 3 too, 4 is uniform; group 0 is stale. `train_groups=2` then takes
    groups 1 and 2 (the first two fresh ones with an advantage), and counts group 3 and the uniform 4 as dropped by
    dynamic sampling, group 0 as stale."""
    g = GRPOSection(group_size=2, prompts_per_step=5, train_groups=2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    fresh = fresh_groups([2, 2, 1, 1, 1, 0, 0, 0, 0, 0], 2, 1)
    assert fresh.tolist() == [False, True, True, True, True]
    advantages, keep, info = step_advantages(rewards, [1] * 10, g, fresh)
    assert keep == [False, False, True, True, True, True, False, False, False, False]
    assert info == {"uniform_groups": 1, "groups_dropped_stale": 1, "groups_dropped": 2}
    assert advantages.tolist() == pytest.approx([-1.0, 1.0, 1.0, -1.0], abs=1e-5)
    assert fresh_groups([9] * 10, 2, None) is None


# -- configuration ---------------------------------------------------------------------------------------------


def test_the_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="level must be one of token, sequence, geometric"):
        RolloutCorrection(level="row")
    with pytest.raises(ValueError, match="level=sequence needs a truncate"):
        RolloutCorrection(level="sequence", truncate=None)
    with pytest.raises(ValueError, match="truncate must be >= 1"):
        RolloutCorrection(truncate=0.5)
    with pytest.raises(ValueError, match=r"reject_low must be in \(0, 1\]"):
        RolloutCorrection(reject_low=1.5)
    with pytest.raises(ValueError, match="reject_high must be >= 1"):
        RolloutCorrection(reject_high=0.5)
    with pytest.raises(ValueError, match="set grpo.fold_logprob=false"):
        GRPOSection(rollout_correction=RolloutCorrection(reject_high=3.0))
    with pytest.raises(ValueError, match="max_trajectory_age must be >= 0"):
        GRPOSection(max_trajectory_age=-1)
    cfg = RLConfig()
    cfg.backend.placement, cfg.backend.async_lag, cfg.grpo.max_trajectory_age = "colocated", 2, 1
    assert any("grpo.max_trajectory_age=1 is below backend.async_lag=2" in p for p in config_problems(cfg))
    cfg.grpo.max_trajectory_age = 2
    assert not any("max_trajectory_age" in p for p in config_problems(cfg))


def test_the_old_truncation_key_names_its_new_place():
    """`backend.is_clip` moved: an override or a YAML with it says where, and a run saved with it resumes when its
    value is the new key's."""
    from megatron_spec.rl import checkpoint
    from megatron_spec.rl.overrides import apply_overrides

    with pytest.raises(ValueError, match="backend.is_clip is now grpo.rollout_correction.truncate"):
        apply_overrides(RLConfig(), ["backend.is_clip=3"])
    cfg = apply_overrides(RLConfig(), ["grpo.rollout_correction.truncate=3"])
    saved = {k: v for k, v in checkpoint.flatten(cfg).items() if not k.startswith("grpo.rollout_correction.")}
    checkpoint.check_same_config({**saved, "backend.is_clip": 3.0}, cfg, "run")
    with pytest.raises(ValueError, match="grpo.rollout_correction.truncate: saved 2.0, now 3.0"):
        checkpoint.check_same_config({**saved, "backend.is_clip": 2.0}, cfg, "run")
