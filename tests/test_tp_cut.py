"""`tp_cut.cut`, the part of each HF tensor vLLM's tensor-parallel loader keeps on a TP rank, on crafted shapes
whose expected cuts are written out from vLLM's loaders: heads split and kv heads replicated when fewer than the
TP ranks, the vocabulary padding edge, experts whose width does not divide, row-parallel weights cut on dim 1 with
their biases whole, and everything else whole."""

import pytest
import torch

from megatron_spec.tp_cut import Geometry, cut, rebuild

L = "model.layers.3."


def cuts(name, shape, geo):
    return [cut(name, shape, geo, r) for r in range(geo.tp)]


def test_query_heads_split_and_kv_heads_replicate_below_tp():
    """8 heads of width 16 over TP 4: 2 heads (32 rows) per rank. kv: 2 heads over TP 4 means 2 replicas per head,
    so ranks 0, 1 read head 0 (rows 0..15) and ranks 2, 3 head 1 (rows 16..31); with 4 kv heads each rank its own;
    the q / k biases follow their weights."""
    geo = Geometry(tp=4, heads=8, kv_heads=2)
    assert cuts(L + "self_attn.q_proj.weight", (128, 64), geo) == [(0, 0, 32), (0, 32, 32), (0, 64, 32),
                                                                  (0, 96, 32)]
    assert cuts(L + "self_attn.k_proj.weight", (32, 64), geo) == [(0, 0, 16), (0, 0, 16), (0, 16, 16), (0, 16, 16)]
    assert cuts(L + "self_attn.v_proj.bias", (32,), geo) == [(0, 0, 16), (0, 0, 16), (0, 16, 16), (0, 16, 16)]
    assert cuts(L + "self_attn.k_proj.weight", (64, 64), Geometry(4, 8, 4)) == [(0, 16 * r, 16) for r in range(4)]
    assert cuts(L + "self_attn.k_proj.weight", (16, 64), Geometry(8, 8, 1)) == [(0, 0, 16)] * 8


def test_vocab_rows_follow_vllms_padding_to_64_then_tp():
    """Vocabulary 1000 over TP 8: padded to 1024, 128 per rank; rank 7's range 896..1023 holds only the original
    rows 896..999 (104). Vocabulary 100 over TP 4: padded to 128, 32 per rank; rank 3 (96..127) gets rows 96..99,
    and over TP 8 (16 per rank) rank 7 (112..127) gets none. The head is cut as the embedding."""
    geo = Geometry(8, 8, 8)
    assert cuts("model.embed_tokens.weight", (1000, 16), geo) == [(0, 128 * r, 128) for r in range(7)] + \
        [(0, 896, 104)]
    assert cuts("lm_head.weight", (100, 16), Geometry(4, 4, 4)) == [(0, 0, 32), (0, 32, 32), (0, 64, 32),
                                                                     (0, 96, 4)]
    assert cuts("lm_head.weight", (100, 16), geo)[6:] == [(0, 96, 4), (0, 100, 0)]


def test_column_and_row_parallel_mlps_and_experts():
    """gate / up (dense and experts) on dim 0, down and o_proj on dim 1, `size // tp` per rank: an expert of width
    7 over TP 2 gives rows 0..2 and 3..5 (vLLM's fused-MoE loader: row 6 on no rank); a row-parallel bias is
    whole."""
    geo = Geometry(2, 4, 2)
    assert cuts(L + "mlp.gate_proj.weight", (12, 8), geo) == [(0, 0, 6), (0, 6, 6)]
    assert cuts(L + "mlp.up_proj.weight", (12, 8), geo) == [(0, 0, 6), (0, 6, 6)]
    assert cuts(L + "mlp.down_proj.weight", (8, 12), geo) == [(1, 0, 6), (1, 6, 6)]
    assert cuts(L + "self_attn.o_proj.weight", (8, 12), geo) == [(1, 0, 6), (1, 6, 6)]
    assert cuts(L + "mlp.experts.5.gate_proj.weight", (7, 8), geo) == [(0, 0, 3), (0, 3, 3)]
    assert cuts(L + "mlp.experts.5.down_proj.weight", (8, 7), geo) == [(1, 0, 3), (1, 3, 3)]
    assert cuts(L + "self_attn.o_proj.bias", (8,), geo) == [None, None]


def test_replicated_tensors_and_drafters_are_whole_and_tp1_never_cuts():
    geo = Geometry(2, 4, 2)
    for name in (L + "input_layernorm.weight", L + "self_attn.q_norm.weight", L + "mlp.gate.weight",
                 "model.norm.weight", "drafter.mtp.layers.0.self_attn.q_proj.weight", "drafter.lm_head.weight"):
        assert cuts(name, (8, 8), geo) == [None, None], name
    assert cut(L + "self_attn.q_proj.weight", (8, 8), Geometry(1, 4, 2), 0) is None


def test_bad_geometry_fails_before_any_cut():
    with pytest.raises(ValueError, match="6 attention heads do not split over TP 4"):
        Geometry(4, 6, 2)
    with pytest.raises(ValueError, match="3 kv heads"):
        Geometry(2, 4, 3)
    with pytest.raises(ValueError, match="rank 2 of TP 2"):
        cut("x", (4,), Geometry(2, 4, 2), 2)


def test_rebuild_puts_the_piece_where_the_loader_narrows():
    full = torch.arange(24.0).view(4, 6)
    out = rebuild((4, 6), 1, 2, full.narrow(1, 2, 3), fill=float("nan"))
    assert torch.equal(out.narrow(1, 2, 3), full.narrow(1, 2, 3))
    assert out.isnan().sum() == 4 * 3
