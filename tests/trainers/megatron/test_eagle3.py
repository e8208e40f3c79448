"""An EAGLE-3 head trained online beside `MegatronPolicy` (`drafters/eagle3/megatron.py`) against the embedded
trainer's EAGLE-3 update, against itself at TP2 / PP2, and its trunk isolation.

The model is the 4-layer tiny dense one of `common.py`; the head fuses layers (0, 1, 3), so at PP2 two of them
come from the first stage and one from the last, and it has a draft vocabulary of 48 ids. 2 steps of lr 1e-3 on
4 rows x 12 tokens (`policy_workers.batches`).

Tolerances are those of `test_policy.py`, for the same reasons: the head's loss and agreement are the same fp32
sums in another order (Megatron's fused QKV and TP-split matmuls move the captured states by a few ulps), rel
1e-5; its weights after the Adam updates, |diff| <= 2 x lr x steps and mean |diff| <= 1e-6 (a wrong state, a
missing stage's layer or a wrong embedding moves most elements by ~lr).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import eagle3_workers as w  # noqa: E402
from .test_policy import REL, close_weights, same_metrics  # noqa: E402


@pytest.fixture(scope="module")
def one():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.one_rank, 1)[0]


@pytest.fixture(scope="module")
def two():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.two_ranks, 2)


def same_head(a: dict, b: dict):
    assert a["drafter_loss"] == pytest.approx(b["drafter_loss"], rel=REL)
    assert a["drafter_agreement"] == pytest.approx(b["drafter_agreement"], rel=REL)


@pytest.mark.megatron_dist
def test_tp1_eagle3_step_equals_the_embedded_trainer(one):
    """Same weights, head and batches: the head's loss, agreement and weights after each step equal the embedded
    trainer's EAGLE-3 update, and the policy's update is the embedded one too; the head travels in the export."""
    ours, ref = one["tp1"], w.embedded_run()
    for step in range(w.STEPS):
        same_metrics(ours["metrics"][step], ref["metrics"][step])
        same_head(ours["metrics"][step], ref["metrics"][step])
        heads = w.head_weights(ours["weights"][step])
        assert sorted(heads) == sorted(w.head_weights(ref["weights"][step])) and "drafter.fc.weight" in heads
        close_weights(heads, w.head_weights(ref["weights"][step]))
        close_weights(ours["weights"][step], {n: t for n, t in ref["weights"][step].items() if n not in heads})
    first, second = (w.head_weights(ours["weights"][s])["drafter.fc.weight"] for s in range(2))
    assert not torch.equal(first, second)  # the head did move


@pytest.mark.megatron_dist
def test_unrolled_drafts_train_as_the_embedded_trainer_does(one):
    """`drafter_train.drafts=3` (EAGLE-3's training-time test: the head unrolled over its own states, every drafted
    position trained): the head's loss, agreement and weights after each step equal the embedded trainer's unrolled
    update, whose agreement has one entry per draft (one for the one-draft update)."""
    ours, ref = one["tp1_drafts"], w.embedded_run(drafts=w.DRAFTS)
    for step in range(w.STEPS):
        same_head(ours["metrics"][step], ref["metrics"][step])
        close_weights(w.head_weights(ours["weights"][step]), w.head_weights(ref["weights"][step]))
    assert (len(ours["metrics"][0]["drafter_agreement"]), len(one["tp1"]["metrics"][0]["drafter_agreement"])) == \
        (w.DRAFTS, 1)


@pytest.mark.megatron_dist
def test_the_head_leaves_the_trunk_gradients_bitwise_unchanged(one):
    g = one["grads"]
    assert sorted(g["eagle3"]["grads"]) == sorted(g["none"]["grads"])
    different = [n for n, t in g["none"]["grads"].items() if not torch.equal(t, g["eagle3"]["grads"][n])]
    assert not different, different[:3]
    assert g["eagle3"]["metrics"]["drafter_loss"] > 0 and "drafter_loss" not in g["none"]["metrics"]


@pytest.mark.megatron_dist
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_eagle3_steps_equal_the_tp1_step(one, two, layout):
    """TP2 and PP2 (the fused layers on both stages) on 2 gloo ranks: the head's loss, agreement and exported
    weights equal TP1's on every rank."""
    ref = one["tp1"]
    for rank in two:
        ours = rank[layout]
        for step in range(w.STEPS):
            same_metrics(ours["metrics"][step], ref["metrics"][step])
            same_head(ours["metrics"][step], ref["metrics"][step])
            assert sorted(ours["weights"][step]) == sorted(ref["weights"][step])
            close_weights(ours["weights"][step], ref["weights"][step])


@pytest.mark.megatron_dist
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_only_the_head_rank_receives_the_head_inputs_and_they_equal_the_all_reduce(two, layout):
    """The head rank is the last stage's first TP / DP rank (rank 0 at TP2, rank 1 at PP2); it alone receives the
    captured states, logits and embedding rows, and they equal, value for value, the all-reduce of every rank's
    pieces (each value added by one rank, zeros by the others: what every rank used to receive)."""
    results = [r[f"gather_{layout}"] for r in two]
    head = results[0]["head_rank"]
    assert [r["head_rank"] for r in results] == [head, head] and head == (1 if layout == "pp2" else 0)
    assert [r["received"] for r in results] == [r["rank"] == head for r in results]
    assert results[head]["equal"] and results[head]["nonzero"] > 0


@pytest.mark.megatron_dist
@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_a_token_budget_sends_the_head_only_its_rows_and_draft_vocabulary(one, two, layout):
    """`drafter_train.max_tokens` (agreement off): the head rank receives only the rows `spread_rows` keeps, and for
    them exactly what the full capture holds: the fused states of those rows, their logits at the draft vocabulary's
    ids, the embedding rows of their tokens (value for value: the same forward, before the same update). Under full
    activation recompute (the layers' forward again inside the backward) the head receives the same, bit for bit:
    the hooks skip the recomputed forward."""
    from megatron_spec.microbatch import spread_rows

    results = [one["budget"]] if layout == "tp1" else [r["budget_pp2"] for r in two]
    got = [r for r in results if r["budget"]["got"] is not None]
    assert len(got) == 1  # the head rank alone
    r = got[0]
    batch = w.batches(w.cfg(), 1)[0]
    rows = spread_rows(batch.mask, w.BUDGET)
    assert r["budget"]["rows"] == rows and 0 < len(rows) < batch.mask.shape[0]
    (full_layers, full_logits, full_ids, full_emb), (layers, logits, ids, emb) = r["all"]["got"], r["budget"]["got"]
    for i, h in layers.items():
        assert torch.equal(h, full_layers[i][rows])
    assert logits.shape[-1] == len(w.D2T) and torch.equal(logits, full_logits[rows][..., w.D2T])
    assert torch.equal(ids, batch.input_ids[rows].unique())
    assert torch.equal(emb, full_emb[torch.searchsorted(full_ids, ids)])
    recomputed = r["recompute"]["got"]
    assert all(torch.equal(a, b) for a, b in zip(recomputed[1:], r["all"]["got"][1:]))
    assert all(torch.equal(recomputed[0][i], full_layers[i]) for i in full_layers)


def test_spread_rows_take_whole_rows_within_the_budget_in_bit_reversed_order():
    """8 rows of 5 positions (2 prompt, 3 generated): a budget of 20 takes 4 rows, 0, 4, 2, 6 (bit-reversed order),
    spread over the batch; a budget below one row still takes row 0; 0 takes every row; a row counts its used
    length (up to its last generated token), so one that ends early costs less."""
    from megatron_spec.microbatch import spread_rows

    mask = torch.zeros(8, 5, dtype=torch.bool)
    mask[:, 2:] = True
    assert spread_rows(mask, 20) == [0, 2, 4, 6]
    assert spread_rows(mask, 4) == [0]
    assert spread_rows(mask, 0) == list(range(8))
    mask[4, 3:] = False  # row 4 uses 3 positions: 5 + 3 + 5 fit in 13, and 5 + 3 + 5 + 5 = 18 in 18
    assert spread_rows(mask, 13) == [0, 2, 4] and spread_rows(mask, 18) == [0, 2, 4, 6]


@pytest.mark.megatron_dist
def test_a_refit_from_every_stage_carries_the_trained_head(two):
    """PP2: stage 0's sender (rank 0) streams the head, which the last stage's rank trains; every rank takes part
    in sharing it (a broadcast all ranks drain, senders or not), so the refit completes and the receiver gets the
    head as its rank holds it after the step."""
    assert "error" not in two[0]["refit_pp2"], two[0]["refit_pp2"].get("error")
    received, head = two[0]["refit_pp2"]["received"], two[1]["refit_pp2"]["head"]
    assert sorted(received) == sorted(f"drafter.{n}" for n in head)
    assert all(torch.equal(received[f"drafter.{n}"], t) for n, t in head.items())


def test_sequence_parallel_slices_assemble_to_the_whole_states():
    """Under sequence parallelism each TP rank holds its own slice of positions of a fused layer's states and sends
    that slice with its start; `assemble` puts two ranks' slices where the whole states (as one rank without SP
    holds them) go: the same tensors, value for value, and the padding past a micro-batch's length stays 0."""
    from megatron_spec.drafters.eagle3.megatron import assemble

    g = torch.Generator().manual_seed(0)
    B, T, H, V = 4, 10, 8, 16
    ids = torch.tensor([1, 3, 5, 9])
    micros = [([0, 2], 8), ([1, 3], 6)]  # (rows, padded length), lengths divisible by tp = 2
    states = {rows[0]: torch.randn(len(rows), t, H, generator=g) for rows, t in micros}
    logits = {rows[0]: torch.randn(len(rows), t, V, generator=g) for rows, t in micros}
    embed = torch.randn(len(ids), H, generator=g)
    common = [(("logits", rows), logits[rows[0]]) for rows, _ in micros] + [(("embed", 0, V), embed)]
    whole = [(("layer", 0, rows, 0), states[rows[0]]) for rows, _ in micros] + common
    sliced = [(("layer", 0, rows, r * t // 2), states[rows[0]][:, r * t // 2 : (r + 1) * t // 2])
              for rows, t in micros for r in (1, 0)] + common
    a, b = assemble(whole, 1, (B, T), H, V, ids), assemble(sliced, 1, (B, T), H, V, ids)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0][0, [0, 2], :8], states[0]) and not a[0][0, :, 8:].any() and torch.equal(a[2], embed)


def test_unsupported_combinations_fail_before_anything_is_built():
    """EAGLE-3 beside MTP layers, a head fusing a layer the policy lacks: each raises in the constructor, before
    torch.distributed or any model exists (no process group here)."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.drafters.eagle3.model import Eagle3Head
    from megatron_spec.drafters.eagle3.model import Eagle3Config

    from .common import tiny
    from .policy_workers import SAMPLING, grpo, our_model

    model = our_model(w.cfg())
    deep = tiny("dense", num_hidden_layers=8)
    cases = [
        (dict(eagle3=w.head(), mtp_num_layers=1), "mtp_num_layers=1"),
        (dict(eagle3=Eagle3Head(deep, Eagle3Config(8, (0, 3, 7)))), r"fuses layer\(s\) \[7\]"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            MegatronPolicy(model, grpo(), SAMPLING, Parallelism(), drafter_cfg=w.drafter_cfg(), **kw)


def test_the_run_check_refuses_eagle3_beside_mtp_layers():
    """`check_inputs` (before any model or file is read) refuses spec.method=eagle3 with the Megatron trainer and
    backend.megatron.mtp_num_layers > 0; with mtp_num_layers 0 it passes on to the next check (the policy files)."""
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import check_inputs
    from megatron_spec.drafters.config import SpecConfig

    cfg = RLConfig()
    cfg.backend.trainer, cfg.spec = "megatron", SpecConfig(method="eagle3")
    cfg.model.policy = "/nonexistent/policy"
    cfg.drafter_train.drafts = cfg.drafter_train.replay = cfg.drafter_train.minibatches = 1
    cfg.backend.megatron.mtp_num_layers = 1
    with pytest.raises(ValueError, match="mtp_num_layers=1 would build MTP layers"):
        check_inputs(cfg)
    cfg.backend.megatron.mtp_num_layers = 0
    with pytest.raises(FileNotFoundError, match="/nonexistent/policy"):
        check_inputs(cfg)
