"""The sharded weight-update group on gloo in spawned processes: two senders (pipeline stages), two engines of TP 2
(four receivers). Each sender has one group per TP rank; worker r of each engine receives only the part of each
tensor vLLM's loader keeps on TP rank r (`tp_cut`), replicated tensors whole, rebuilt to the full shape with the
part in its place; FRAMED on the first refit, PACKED after; a sender failing mid-stream in a PACKED refit reaches
every receiver as RefitAborted and the next refit recovers."""

import pickle

import pytest
import torch

from megatron_spec.distributed.process_groups import free_port
from megatron_spec.distributed.weight_group import RefitAborted, WeightGroup
from tests.placement.test_weight_group_senders import counted_posts, in_turn, spawn

SENDERS, TP, WORLD = 2, 2, 6
GEO = {"tp": 2, "heads": 4, "kv_heads": 1}
SHAPES = [
    [[("model.embed_tokens.weight", (70, 4)), ("model.layers.0.input_layernorm.weight", (4,))],
     [("model.layers.0.self_attn.q_proj.weight", (8, 4)), ("model.layers.0.self_attn.k_proj.weight", (2, 4)),
      ("model.layers.0.self_attn.v_proj.weight", (2, 4)), ("model.layers.0.self_attn.o_proj.weight", (4, 8))]],
    [[("model.layers.1.mlp.experts.0.gate_proj.weight", (7, 4)),
      ("model.layers.1.mlp.experts.0.down_proj.weight", (4, 7)), ("model.layers.1.mlp.gate.weight", (2, 4))],
     [("lm_head.weight", (70, 4)), ("drafter.fc.weight", (3, 3))]],
]
"""Per sender, its buckets of (name, shape): 4 heads of width 2 and 1 kv head (replicated on both TP ranks), a
vocabulary of 70 (padded to 128: rank 0 rows 0..63, rank 1 rows 64..69), an expert of width 7 (3 rows per rank,
the last row on neither), a norm, a router gate and a drafter tensor (whole)."""
CUTS = {  # (dim, start, length) per TP rank, written out from vLLM's loaders (not from tp_cut)
    "model.embed_tokens.weight": [(0, 0, 64), (0, 64, 6)], "lm_head.weight": [(0, 0, 64), (0, 64, 6)],
    "model.layers.0.self_attn.q_proj.weight": [(0, 0, 4), (0, 4, 4)],
    "model.layers.0.self_attn.k_proj.weight": [(0, 0, 2), (0, 0, 2)],
    "model.layers.0.self_attn.v_proj.weight": [(0, 0, 2), (0, 0, 2)],
    "model.layers.0.self_attn.o_proj.weight": [(1, 0, 4), (1, 4, 4)],
    "model.layers.1.mlp.experts.0.gate_proj.weight": [(0, 0, 3), (0, 3, 3)],
    "model.layers.1.mlp.experts.0.down_proj.weight": [(1, 0, 3), (1, 3, 3)],
}


def stage(sender: int, refit: int):
    g = torch.Generator().manual_seed(100 * sender + refit)
    return [[(n, torch.randn(*shape, generator=g)) for n, shape in bucket] for bucket in SHAPES[sender]]


def _member(rank, port, plan, out):
    group = WeightGroup("127.0.0.1", port, rank, WORLD, 60, "gloo", senders=SENDERS, shard=GEO)
    posts = counted_posts(group)
    results = []
    for refit, what in enumerate(plan):
        posts.clear()
        try:
            if group.is_sender:
                def stream():
                    for i, b in enumerate(stage(rank, refit)):
                        if what == "fail" and rank == 1 and i == 1:
                            raise ValueError("export failed")
                        yield b
                results.append(("sent", group.send(stream(), torch.bfloat16), len(posts), len(group.pgs)))
            else:
                r = (rank - SENDERS) % TP
                got = [[(n, t.shape, (t if n not in CUTS else t.narrow(*CUTS[n][r])).clone()) for n, t in b]
                       for b in group.receive()]
                results.append(("received", got, group.received, len(posts), len(group.pgs)))
        except (ValueError, RuntimeError) as err:
            results.append((type(err).__name__, str(err)))
    out.put((rank, pickle.dumps(results)))


def _run(plan):
    return spawn(_member, plan, world=WORLD, timeout=240)


RECEIVED = {0: 1210, 1: 282}
"""bf16 bytes worker r receives per refit. Sender 0, rank 0: embedding 64x4 + norm 4 + q 4x4 + k 2x4 + v 2x4 +
o 4x4 = 308 elements; rank 1: 6x4 + 4 + 16 + 8 + 8 + 16 = 76. Sender 1, rank 0: expert gate 3x4 + down 4x3 +
router 2x4 + head 64x4 + drafter 9 = 297; rank 1: 12 + 12 + 8 + 6x4 + 9 = 65. Rank 0: (308 + 297) x 2 = 1210,
rank 1: (76 + 65) x 2 = 282, against 1434 for whole tensors."""
SENT = {0: (308 + 76) * 2, 1: (297 + 65) * 2}


def _check_refit(results, refit, sender_posts, receiver_posts):
    for s in range(SENDERS):
        assert results[s][refit] == ("sent", SENT[s], sender_posts[s], TP)
    for rank in range(SENDERS, WORLD):
        r = (rank - SENDERS) % TP
        status, got, received, posts, groups = results[rank][refit]
        assert (status, received, posts, groups) == ("received", RECEIVED[r], receiver_posts, SENDERS)
        want = in_turn(stage(0, refit), stage(1, refit))
        assert len(got) == len(want)
        for sent, recv in zip(want, got, strict=True):
            assert [n for n, _ in sent] == [n for n, _, _ in recv]
            for (name, a), (_, shape, b) in zip(sent, recv):
                assert shape == a.shape  # rebuilt to the full shape for vLLM's loader
                piece = a if name not in CUTS else a.narrow(*CUTS[name][r])
                assert torch.equal(piece.to(torch.bfloat16), b), (name, r)


def test_each_worker_receives_exactly_its_tp_ranks_pieces_framed_then_packed():
    """Two refits. Each sender sends into its 2 groups; refit 0 FRAMED: 3 broadcasts per bucket and group (2 x 2)
    plus an end mark per group = 14 on a sender, 2 x 3 + 1 = 7 per sender on a receiver; refit 1 PACKED: 1 per
    bucket and group plus the end marks = 6 on a sender, 2 + 1 = 3 per sender on a receiver. Every receiver's
    pieces equal the sender's cut, cast to bf16, bit for bit, and its byte count is its rank's (RECEIVED)."""
    results = _run(["ok", "ok"])
    _check_refit(results, 0, {0: 14, 1: 14}, 2 * 7)
    _check_refit(results, 1, {0: 6, 1: 6}, 2 * 3)


def test_a_sender_failing_mid_packed_refit_aborts_every_worker_and_the_next_refit_recovers():
    """Refit 1 (PACKED): sender 1 raises at its second bucket after its first went to both groups; sender 0's
    refit completes, every receiver (both TP ranks of both engines) raises RefitAborted naming sender 1, and
    refit 2 arrives whole: sender 0 PACKED (6 broadcasts), sender 1 FRAMED again (14)."""
    results = _run(["ok", "fail", "ok"])
    assert results[1][1] == ("ValueError", "export failed")
    assert results[0][1] == ("sent", SENT[0], 6, TP)
    for rank in range(SENDERS, WORLD):
        assert results[rank][1][0] == "RefitAborted" and "sender 1" in results[rank][1][1]
    _check_refit(results, 2, {0: 6, 1: 14}, 3 + 7)


def test_receivers_that_are_not_whole_engines_are_refused_before_any_rendezvous():
    with pytest.raises(ValueError, match="3 receivers are not engines of TP 2"):
        WeightGroup("127.0.0.1", free_port(), 0, 4, 5, "gloo", senders=1, shard=GEO)
    with pytest.raises(ValueError, match="paired .* cannot also be sharded"):
        WeightGroup("127.0.0.1", free_port(), 0, 2, 5, "gloo", senders=1, paired=True, shard=GEO)
