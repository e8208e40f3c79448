"""Pure HF <-> Megatron mapping: names, QKV / gate-up layouts, vocabulary padding, expert ownership.
No megatron-core and no process group needed."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.trainers.megatron import mapping as M

from .common import MTP_LAYERS, hf_tensors, tiny


def rows(*labels: float) -> torch.Tensor:
    return torch.tensor(labels, dtype=torch.float32)[:, None].repeat(1, 3)


def test_qkv_is_grouped_per_query_group_and_tp_keeps_whole_groups():
    # 4 query heads, 2 groups, head_dim 1: group g holds its 2 query heads, then k_g, then v_g.
    q, k, v = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)
    qkv = M.merge_qkv(q, k, v, num_query_groups=2)
    assert qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    spec = M.ParamSpec(M.QKV, ("q", "k", "v"))
    assert M.shard(spec, qkv, tp=2, rank=1)[:, 0].tolist() == [2, 3, 11, 21]
    back = M.split_qkv(qkv, num_heads=4, num_query_groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_split_inverts_merge_for_real_shapes():
    cfg = tiny("dense")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * cfg.head_dim, cfg.hidden_size, generator=g) for n in (4, 2, 2))
    out = M.split_qkv(M.merge_qkv(q, k, v, 2), 4, 2, cfg.head_dim)
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v)))


@pytest.mark.parametrize("tp, expected", [(1, [0, 1, 2, 3, 10, 11, 12, 13]), (2, [0, 1, 10, 11, 2, 3, 12, 13])])
def test_fc1_holds_gate_then_up_per_rank(tp, expected):
    gate, up = rows(0, 1, 2, 3), rows(10, 11, 12, 13)
    fc1 = M.merge_fc1(gate, up, tp)
    assert fc1[:, 0].tolist() == expected
    g2, u2 = M.split_fc1(fc1, tp)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_vocab_padding_follows_megatron_lm_rule():
    assert M.padded_vocab_size(151936, 128, 1) == 151936
    assert M.padded_vocab_size(151936, 128, 2) == 152064
    assert M.padded_vocab_size(96, 128, 1) == 128
    t = torch.randn(96, 4)
    padded = M.pad_vocab(t, 128)
    assert padded.shape == (128, 4) and torch.equal(padded[:96], t) and not padded[96:].any()
    assert torch.equal(M.trim_vocab(padded, 96), t)
    with pytest.raises(ValueError, match="does not fit"):
        M.pad_vocab(t, 64)


def test_experts_belong_to_ep_ranks_by_consecutive_global_ids():
    assert [M.expert_owner(e, 8, 4) for e in range(8)] == [(r, i) for r in range(4) for i in range(2)]
    assert [M.global_expert(i, r, 8, 4) for r in range(4) for i in range(2)] == list(range(8))
    with pytest.raises(ValueError, match="EP=3 does not divide num_experts=8"):
        M.expert_owner(0, 8, 3)


@pytest.mark.parametrize(
    "name, offset, kind, hf",
    [
        ("embedding.word_embeddings.weight", 0, M.VOCAB, ("model.embed_tokens.weight",)),
        ("output_layer.weight", 0, M.VOCAB, ("lm_head.weight",)),
        ("decoder.final_layernorm.weight", 0, M.REPLICATED, ("model.norm.weight",)),
        ("decoder.layers.0.input_layernorm.weight", 3, M.REPLICATED, ("model.layers.3.input_layernorm.weight",)),
        ("decoder.layers.1.self_attention.linear_qkv.weight", 3, M.QKV,
         tuple(f"model.layers.4.self_attn.{p}_proj.weight" for p in "qkv")),
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 0, M.REPLICATED,
         ("model.layers.0.input_layernorm.weight",)),  # TE fuses the norm into linear_qkv
        ("decoder.layers.0.self_attention.q_layernorm.weight", 0, M.REPLICATED, ("model.layers.0.self_attn.q_norm.weight",)),
        ("decoder.layers.0.self_attention.k_layernorm.weight", 0, M.REPLICATED, ("model.layers.0.self_attn.k_norm.weight",)),
        ("decoder.layers.0.self_attention.linear_proj.weight", 0, M.ROW, ("model.layers.0.self_attn.o_proj.weight",)),
        ("decoder.layers.0.pre_mlp_layernorm.weight", 0, M.REPLICATED, ("model.layers.0.post_attention_layernorm.weight",)),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 0, M.REPLICATED,
         ("model.layers.0.post_attention_layernorm.weight",)),
        ("decoder.layers.0.mlp.linear_fc1.weight", 0, M.FC1,
         ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")),
        ("decoder.layers.0.mlp.linear_fc2.weight", 0, M.ROW, ("model.layers.0.mlp.down_proj.weight",)),
        ("decoder.layers.0.mlp.router.weight", 0, M.REPLICATED, ("model.layers.0.mlp.gate.weight",)),
        ("mtp.layers.1.enorm.weight", 0, M.REPLICATED, ("mtp.layers.1.enorm.weight",)),
        ("mtp.layers.1.hnorm.weight", 0, M.REPLICATED, ("mtp.layers.1.hnorm.weight",)),
        ("mtp.layers.0.eh_proj.weight", 0, M.COLUMN, ("mtp.layers.0.eh_proj.weight",)),
        ("mtp.layers.0.final_layernorm.weight", 0, M.REPLICATED, ("mtp.layers.0.final_layernorm.weight",)),
        ("mtp.layers.0.transformer_layer.self_attention.linear_proj.weight", 5, M.ROW,
         ("mtp.layers.0.transformer_layer.self_attn.o_proj.weight",)),  # megatron-core 0.16
        ("mtp.layers.0.mtp_model_layer.mlp.linear_fc2.weight", 5, M.ROW,
         ("mtp.layers.0.transformer_layer.mlp.down_proj.weight",)),  # megatron-core 0.19
    ],
)
def test_megatron_names_map_to_hf_names(name, offset, kind, hf):
    spec = M.megatron_to_hf(name, offset)
    assert (spec.kind, spec.hf_names, spec.is_expert, spec.export) == (kind, hf, False, True)


@pytest.mark.parametrize(
    "name", ["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",  # SequentialMLP
             "decoder.layers.1.mlp.experts.linear_fc1.weight1"],  # TEGroupedMLP
)
def test_expert_names_take_the_global_id(name):
    spec = M.megatron_to_hf(name, layer_offset=2)
    assert spec.kind == M.FC1 and spec.local_expert == 1
    assert spec.names(global_expert=5) == (
        "model.layers.3.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="global expert id"):
        spec.names()


def test_copies_on_later_stages_are_not_exported():
    assert not M.megatron_to_hf("embedding.word_embeddings.weight", first_stage=False).export
    tied = M.megatron_to_hf("output_layer.weight", tied=True)
    assert tied.hf_names == ("model.embed_tokens.weight",) and not tied.export


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match="no HF name for Megatron parameter 'decoder.layers.0.mlp.linear_fc3.weight'"):
        M.megatron_to_hf("decoder.layers.0.mlp.linear_fc3.weight")
    with pytest.raises(ValueError, match="no HF name"):
        M.megatron_to_hf("something.else")


def test_expected_names_are_the_policy_and_drafter_state_dicts():
    for kind in ("dense", "moe"):
        cfg = tiny(kind)
        assert M.expected_hf_names(cfg, MTP_LAYERS) == set(hf_tensors(cfg, MTP_LAYERS))
    tied = tiny("dense", model_type="llama", tie_word_embeddings=True, qk_norm=False)
    assert "lm_head.weight" not in M.expected_hf_names(tied)


def test_vllm_names_follow_qwen3_next_mtp():
    assert M.vllm_mtp_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert M.vllm_mtp_name("mtp.layers.0.enorm.weight") == "mtp.pre_fc_norm_embedding.weight"
    assert M.vllm_mtp_name("mtp.layers.0.hnorm.weight") == "mtp.pre_fc_norm_hidden.weight"
    assert M.vllm_mtp_name("mtp.layers.0.eh_proj.weight") == "mtp.fc.weight"
    assert M.vllm_mtp_name("mtp.layers.0.final_layernorm.weight") == "mtp.norm.weight"
    assert (M.vllm_mtp_name("mtp.layers.1.transformer_layer.mlp.experts.3.up_proj.weight")
            == "mtp.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(ValueError, match="only load an MTP block with one layer"):
        M.vllm_mtp_name("mtp.layers.1.eh_proj.weight")


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_tensor_survives_shard_then_gather(kind, tp):
    """The importer's and exporter's per-tensor path, simulated without processes: HF -> full Megatron tensor ->
    tp shards -> gathered -> HF is the identity, bitwise, for every tensor of the policy and the drafter."""
    cfg = tiny(kind)
    hf = hf_tensors(cfg)
    padded = M.padded_vocab_size(cfg.vocab_size, 128, tp)
    seen = set()
    for name, spec in _all_specs(cfg):
        shards = [M.shard(spec, M.to_megatron(spec, tuple(hf[n] for n in name), cfg, tp, padded), tp, r) for r in range(tp)]
        back = M.from_megatron(spec, M.unshard(spec, shards), cfg, tp)
        assert all(torch.equal(b, hf[n]) for b, n in zip(back, name)), name
        direct = M.from_megatron_shards(spec, shards, cfg)  # the exporter's one-copy path
        assert all(torch.equal(b, hf[n]) for b, n in zip(direct, name)), name
        seen |= set(name)
    assert seen == set(hf)


def _all_specs(cfg):
    """(HF names, spec) for every Megatron parameter of `cfg` with MTP_LAYERS MTP layers, built from the table."""
    layer_parts = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
                   "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    mlp = (["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(cfg.num_experts)
                                    for i in (1, 2)]) if cfg.is_moe else ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in layer_parts + mlp]
    for d in range(MTP_LAYERS):
        names += [f"mtp.layers.{d}.{p}" for p in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                   "final_layernorm.weight")]
        names += [f"mtp.layers.{d}.transformer_layer.{p}" for p in layer_parts + mlp]
    for n in names:
        spec = M.megatron_to_hf(n)
        yield spec.names(spec.local_expert if spec.is_expert else None), spec


def test_vllm_stream_renames_the_drafter_and_can_zero_centre_its_norms():
    cfg = tiny("moe")
    one_depth = {n: t for n, t in hf_tensors(cfg, mtp_layers=1).items()}
    plain = dict(M.rename_for_vllm(one_depth.items()))
    assert len(plain) == len(one_depth)
    assert torch.equal(plain["mtp.fc.weight"], one_depth["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(plain["mtp.layers.0.mlp.experts.2.down_proj.weight"],
                       one_depth["mtp.layers.0.transformer_layer.mlp.experts.2.down_proj.weight"])
    assert torch.equal(plain["model.norm.weight"], one_depth["model.norm.weight"])
    gemma = dict(M.rename_for_vllm(one_depth.items(), zero_centered_mtp_norms=True))
    assert torch.equal(gemma["mtp.norm.weight"], one_depth["mtp.layers.0.final_layernorm.weight"] - 1)
    assert torch.equal(gemma["mtp.layers.0.self_attn.q_norm.weight"],
                       one_depth["mtp.layers.0.transformer_layer.self_attn.q_norm.weight"] - 1)
    assert torch.equal(gemma["model.norm.weight"], one_depth["model.norm.weight"])  # the trunk keeps its norms
    with pytest.raises(ValueError, match="one layer"):
        dict(M.rename_for_vllm(hf_tensors(cfg, mtp_layers=2).items()))
