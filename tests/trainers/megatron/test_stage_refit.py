"""A sender per pipeline stage (`refit_stream.send_stages`), Megatron PP2 x EP2 on 4 gloo ranks and one receiver:
the receiver gets bit for bit the whole model in the engines' bf16 (the export every rank used to gather, cast),
each stage's first rank sends exactly its own stage's tensors and receives only the other EP rank's experts while
gathering, and the stage's other ranks receive nothing (nothing from the other stage either). The per-GPU refit
(CUDA IPC's paired group, run here on gloo): every rank sends the whole model to its own receiver."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")
pytestmark = pytest.mark.megatron_dist


@pytest.fixture(scope="module")
def runs():
    from megatron_spec.trainers.megatron.parallel import spawn

    from .stage_refit_workers import run

    return spawn(run, 4)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_receiver_gets_the_whole_model_from_two_senders(runs):
    """Both refits (FRAMED, then PACKED) deliver every tensor of the bf16 export, bitwise, MTP layers included, and
    the receiver counts exactly the model's bytes (for the last refit: each refit starts the count again)."""
    assert "error" not in runs[0], runs[0].get("error")
    whole = runs[0]["whole"]
    for got in runs[0]["got"]:
        assert sorted(got) == sorted(whole)
        assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], whole[n]) for n in whole)
    assert runs[0]["received"] == _bytes(whole.values())


def test_each_stage_sends_its_own_share_and_receives_nothing_of_the_other(runs):
    """Two senders (ranks 0 and 2, the stages' first ranks), each sending exactly the bytes of the tensors its
    stage owns (the stages partition the model); each sender received while gathering exactly the other EP rank's
    experts of its stage (the bytes of its stage's expert tensors it does not hold), and the other ranks of the
    stage received nothing: they send their experts to the sender and yield only the dense tensors. The other
    stage's tensors never appear in a stage's stream."""
    whole = runs[0]["whole"]
    assert [r["sender"] for r in runs] == [True, False, True, False]
    by_stage = {r["pp_rank"]: set(r["own"]) for r in runs if r["sender"]}
    assert by_stage[0] | by_stage[1] == set(whole) and not by_stage[0] & by_stage[1]
    share = {s: _bytes(whole[n] for n in names) for s, names in by_stage.items()}
    for r in runs:
        if not r["sender"]:
            assert set(r["own"]) < by_stage[r["pp_rank"]] and not any(".experts." in n for n in r["own"])
    for stats in runs[0]["stats"]:
        assert stats["sender_bytes"] == [share[0], share[1]]
        for r, received in zip(runs, stats["received_bytes"]):
            if r["sender"]:
                assert received == r["others_experts"] and 0 < received < share[r["pp_rank"]]
            else:
                assert received == 0
        assert all(r["stats"] == runs[0]["stats"] for r in runs)


def test_the_per_gpu_stream_brings_every_rank_the_whole_model_and_counts_what_it_received(runs):
    """The per-GPU CUDA IPC refit's stream (`refit_buckets`): every rank yields the whole bf16 model, and counts as
    received exactly the other stage's tensors plus, from its own stage's gathers, the other EP rank's experts."""
    whole = runs[0]["whole"]
    by_stage = {r["pp_rank"]: r["own"] for r in runs if r["sender"]}
    for r in runs:
        other = _bytes(whole[n] for n in by_stage[1 - r["pp_rank"]])
        assert r["walked"] == _bytes(whole.values())
        assert r["whole_received"] == other + r["others_experts"]


@pytest.fixture(scope="module")
def paired():
    from megatron_spec.trainers.megatron.parallel import spawn

    from .stage_refit_workers import run_paired

    return spawn(run_paired, 4)


def test_per_gpu_every_rank_sends_the_whole_model_to_its_own_receiver(paired, runs):
    """The per-GPU refit (CUDA IPC's paired group, here on gloo): each of the 4 ranks is a sender of a pair, and
    its receiver gets the whole bf16 model bitwise in both refits (FRAMED, then PACKED), from its sender only;
    every sender sends the whole model's bytes, and each rank received the other stage's tensors and its own
    stage's other EP rank's experts while walking it."""
    whole_bytes = _bytes(paired[0]["whole"].values())
    by_stage = {r["pp_rank"]: r["own"] for r in runs if r["sender"]}
    for rank, r in enumerate(paired):
        assert "error" not in r, r.get("error")
        assert r["paired"] and r["groups"] == 1 and r["received"] == whole_bytes
        for got in r["got"]:
            assert sorted(got) == sorted(r["whole"])
            assert all(torch.equal(got[n], r["whole"][n]) for n in r["whole"])
        for stats in r["stats"]:
            assert stats["sender_bytes"] == [whole_bytes] * 4
            for q, received in enumerate(stats["received_bytes"]):
                other = _bytes(r["whole"][n] for n in by_stage[1 - runs[q]["pp_rank"]])
                assert received == other + runs[q]["others_experts"]
