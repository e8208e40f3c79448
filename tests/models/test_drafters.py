"""Drafter modules (MTP, EAGLE-3): shapes, stable names, save/load, KV-cache equivalence, gradient isolation."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from megatron_spec import kernels
from megatron_spec.models.config import ModelConfig
from megatron_spec.models.decoder import CausalLM
from megatron_spec.drafters.files import check_draft_model, load_drafter, save_drafter
from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head, default_capture_layers
from megatron_spec.models.kv_cache import KVCache
from megatron_spec.models.layers import MLP, MoE
from megatron_spec.drafters.mtp.model import MTP, MTPConfig

B, T, H = 2, 7, 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These matrices are tiny: on a busy CI box a thread pool costs far more than it saves (seen: 3 ms per 32x32
    matmul with 2 threads vs 0.05 ms with 1). Restored afterwards so other test modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(**overrides) -> ModelConfig:
    base = dict(
        model_type="qwen3", vocab_size=40, hidden_size=H, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, qk_norm=True,
    )
    return ModelConfig(**{**base, **overrides})


def tiny_moe(**overrides) -> ModelConfig:
    return tiny(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **overrides)


def make_target(cfg: ModelConfig | None = None) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(cfg or tiny()).eval()


def make_drafter(kind: str, target: CausalLM):
    torch.manual_seed(1)
    if kind == "mtp":
        return MTP(target.config, MTPConfig(num_layers=2))
    return Eagle3Head.from_target(target, Eagle3Config(target.config.num_hidden_layers, (0, 1, 3)))


def token_ids(vocab: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def draft_logits(kind: str, drafter, target: CausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced logits of every depth (MTP) or of the first draft step (EAGLE-3) over `ids`."""
    out = target.trunk(ids, capture=() if kind == "mtp" else drafter.capture_layers)
    if kind == "mtp":
        return drafter.forward_all(out.hidden.detach(), ids, None, target.embed, target.lm_head)
    return [drafter(drafter.fuse(out.layers)[:, :-1], ids[:, 1:], None, target.embed)[1]]


class AppendCache:
    """Test KV cache: per layer, append the step's keys/values along time; boolean causal mask with an offset."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer, k, v):
        n_new = k.shape[2]
        if layer in self.k:
            k, v = torch.cat((self.k[layer], k), dim=2), torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        n = k.shape[2]
        query_pos = torch.arange(n - n_new, n)[:, None]
        return k, v, (torch.arange(n)[None, :] <= query_pos)[None, None]


# Prefill a chunk of 3, then decode one position at a time: exercises the mask for multi- and single-token steps.
CHUNKS = [(0, 3), (3, 4), (4, 5), (5, 6)]


def positions(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end).expand(B, -1)


# ---------------------------------------------------------------------------------------------------- shapes, names

ATTN = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
DENSE_MLP = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def test_mtp_names_shapes_and_cache_layers():
    target = make_target()
    mtp = MTP(target.config, MTPConfig(num_layers=2))
    layer_names = ["input_layernorm.weight", "post_attention_layernorm.weight", *ATTN, *DENSE_MLP]
    per_depth = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"]
    per_depth += [f"transformer_layer.{n}" for n in layer_names]
    assert sorted(mtp.state_dict()) == sorted(f"mtp.layers.{i}.{n}" for i in range(2) for n in per_depth)
    assert mtp.layers[0].eh_proj.weight.shape == (H, 2 * H)
    assert [d.transformer_layer.self_attn.layer for d in mtp.layers] == [4, 5]  # extra cache layers after the trunk

    ids = token_ids()
    hidden = target.trunk(ids).hidden
    state, logits = mtp(hidden[:, :-1], ids[:, 1:], None, target.embed, target.lm_head)
    assert state.shape == (B, T - 1, H) and logits.shape == (B, T - 1, 40)
    assert [x.shape[1] for x in mtp.forward_all(hidden, ids, None, target.embed, target.lm_head)] == [T - 1, T - 2]
    with pytest.raises(ValueError, match="out of range"):
        mtp(hidden, ids, None, target.embed, target.lm_head, layer=2)


def test_mtp_eh_proj_reads_embedding_half_first():
    target = make_target()
    mtp = MTP(target.config)
    with torch.no_grad():
        mtp.layers[0].eh_proj.weight[:, H:] = 0  # silence the hidden half
    ids = token_ids()
    h1, h2 = torch.randn(B, T, H), torch.randn(B, T, H)
    same = [mtp(h, ids, None, target.embed, target.lm_head)[1] for h in (h1, h2)]
    torch.testing.assert_close(same[0], same[1])
    other_tokens = mtp(h1, token_ids(seed=2), None, target.embed, target.lm_head)[1]
    assert not torch.allclose(same[0], other_tokens)


def test_mtp_forward_is_the_megatron_formula():
    """With the decoder layer's two residual branches silenced, the layer is the identity, so the depth's state is
    final_layernorm(eh_proj(cat[enorm(embed(token)), hnorm(h)])) and its logits are the target's head on it."""
    target = make_target()
    mtp = MTP(target.config)
    d = mtp.layers[0]
    with torch.no_grad():
        d.transformer_layer.self_attn.o_proj.weight.zero_()
        d.transformer_layer.mlp.down_proj.weight.zero_()
        for norm in (d.enorm, d.hnorm, d.final_layernorm):
            norm.weight.uniform_(0.5, 1.5)
        ids, h = token_ids(), torch.randn(B, T, H)
        state, logits = mtp(h, ids, None, target.embed, target.lm_head)
        x = d.eh_proj(torch.cat((d.enorm(target.embed(ids)), d.hnorm(h)), -1))
        torch.testing.assert_close(state, d.final_layernorm(x))
        torch.testing.assert_close(logits, target.lm_head(state))


def test_mtp_layer_kind_follows_trunk_last_layer():
    assert isinstance(MTP(tiny_moe()).layers[0].transformer_layer.mlp, MoE)
    # Last trunk layer (3) kept dense: the MTP layer is dense too, though index 4 alone would say MoE.
    cfg = tiny_moe(mlp_only_layers=(3,))
    assert cfg.is_moe_layer(4) and not cfg.is_moe_layer(3)
    assert isinstance(MTP(cfg).layers[0].transformer_layer.mlp, MLP)


def test_eagle3_names_shapes_and_head_init():
    target = make_target()
    head = Eagle3Head.from_target(target)
    expected = ["fc.weight", "norm.weight", "lm_head.weight"] + [
        f"midlayer.{n}"
        for n in ["input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight", *ATTN, *DENSE_MLP]
    ]
    assert sorted(head.state_dict()) == sorted(expected)
    assert head.fc.weight.shape == (H, 3 * H)
    assert head.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 2 * H)
    assert head.midlayer.self_attn.k_proj.weight.shape == (2 * 8, 2 * H)
    assert head.midlayer.self_attn.layer == 4
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert head.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, trained separately

    ids = token_ids()
    out = target.trunk(ids, capture=head.capture_layers)
    fused = head.fuse(out.layers)
    state, logits = head(fused, ids, None, target.embed)
    assert fused.shape == state.shape == (B, T, H) and logits.shape == (B, T, 40)
    with pytest.raises(KeyError, match="capture"):
        head.fuse({})


def test_eagle3_forward_keeps_the_raw_hidden_as_residual():
    """With attention and MLP outputs silenced the layer passes its (un-normed) hidden input through, and the logits
    are lm_head(norm(state)); the embedding only enters through attention."""
    target = make_target()
    head = make_drafter("eagle3", target)
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.uniform_(0.5, 1.5)
        h = 3 * torch.randn(B, T, H)
        state, logits = head(h, token_ids(), None, target.embed)
        torch.testing.assert_close(state, h)
        torch.testing.assert_close(logits, head.lm_head(head.norm(h)))


def test_eagle3_without_qk_norm_has_no_norm_weights():
    head = Eagle3Head(tiny(model_type="llama", qk_norm=False))
    assert not [n for n in head.state_dict() if "q_norm" in n or "k_norm" in n]


def test_eagle3_capture_rule_and_config_validation():
    assert default_capture_layers(36) == (1, 17, 32)  # EAGLE-3 on a 36-layer target
    assert default_capture_layers(8) == (1, 3, 4)
    assert default_capture_layers(6) == (1, 2, 2)
    assert default_capture_layers(4) == (1, 1, 1)
    assert default_capture_layers(1) == (0, 0, 0)
    assert Eagle3Config(target_num_layers=32).capture_layers == (1, 15, 28)
    with pytest.raises(ValueError, match="outside"):
        Eagle3Config(4, (1, 2, 4))
    with pytest.raises(ValueError, match="three"):
        Eagle3Config(4, (1, 2))
    with pytest.raises(ValueError, match="8-layer"):
        Eagle3Head(tiny(), Eagle3Config(8))
    with pytest.raises(ValueError, match="num_layers"):
        MTPConfig(num_layers=0)


# ----------------------------------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_save_load_round_trip(kind, tmp_path):
    target = make_target()
    drafter = make_drafter(kind, target)
    save_drafter(drafter, tmp_path / "d", kind, target.config)

    meta = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    assert meta["kind"] == kind and meta["target"]["vocab_size"] == 40 and meta["target"]["head_dim"] == 8
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(drafter.state_dict())  # the target's embedding/head are not saved

    loaded = load_drafter(tmp_path / "d", target.config, torch.float32)
    assert type(loaded) is type(drafter)
    ids = token_ids()
    with torch.no_grad():
        for a, b in zip(draft_logits(kind, drafter, target, ids), draft_logits(kind, loaded, target, ids), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_load_rejects_other_target_before_reading_tensors(kind, tmp_path):
    target = make_target()
    save_drafter(make_drafter(kind, target), tmp_path / "d", kind, target.config)
    # With the weights gone, any attempt to read them would raise FileNotFoundError instead of the ValueError.
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="architecture.*hidden_size: drafter 32 vs target 64"):
        load_drafter(tmp_path / "d", tiny(hidden_size=64, head_dim=16), torch.float32)
    with pytest.raises(ValueError, match="vocabulary.*vocab_size: drafter 40 vs target 41"):
        load_drafter(tmp_path / "d", tiny(vocab_size=41), torch.float32)


def test_save_rejects_wrong_kind_or_target(tmp_path):
    target = make_target()
    mtp = MTP(target.config)
    with pytest.raises(ValueError, match="needs a Eagle3Head"):
        save_drafter(mtp, tmp_path / "d", "eagle3", target.config)
    with pytest.raises(ValueError, match="save_pretrained"):
        save_drafter(mtp, tmp_path / "d", "draft_model", target.config)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        save_drafter(mtp, tmp_path / "d", "mtp", tiny(num_hidden_layers=2))
    assert not (tmp_path / "d").exists()


def test_check_draft_model_vocab():
    check_draft_model(tiny(hidden_size=16, head_dim=4, num_hidden_layers=1), tiny())
    with pytest.raises(ValueError, match="41 tokens.*40"):
        check_draft_model(tiny(vocab_size=41), tiny())


# --------------------------------------------------------------------------------------------- KV cache, step by step

@pytest.mark.parametrize("cfg", [tiny(), tiny_moe()], ids=["dense", "moe"])
def test_mtp_stepwise_through_cache_equals_full_sequence(cfg):
    target = make_target(cfg)
    mtp = MTP(cfg, MTPConfig(num_layers=2))
    ids = token_ids()
    with torch.no_grad():
        hidden = target.trunk(ids).hidden
        full = mtp.forward_all(hidden, ids, None, target.embed, target.lm_head)

        cache = AppendCache()
        states, logits = [], []
        for s, e in CHUNKS:  # depth 0 over positions 0..T-2
            st, lg = mtp(hidden[:, s:e], ids[:, s + 1 : e + 1], positions(s, e), target.embed, target.lm_head, cache)
            states.append(st)
            logits.append(lg)
        torch.testing.assert_close(torch.cat(logits, 1), full[0], atol=1e-5, rtol=0)
        depth0 = torch.cat(states, 1)
        logits = []
        for s, e in CHUNKS[:-1]:  # depth 1 chains depth 0's states over positions 0..T-3
            st, lg = mtp(depth0[:, s:e], ids[:, s + 2 : e + 2], positions(s, e), target.embed, target.lm_head, cache, 1)
            logits.append(lg)
        torch.testing.assert_close(torch.cat(logits, 1), full[1], atol=1e-5, rtol=0)
    assert sorted(cache.k) == [4, 5] and cache.k[4].shape[2] == T - 1 and cache.k[5].shape[2] == T - 2


def test_eagle3_stepwise_through_cache_equals_full_sequence():
    target = make_target()
    head = make_drafter("eagle3", target)
    ids = token_ids()
    with torch.no_grad():
        fused = head.fuse(target.trunk(ids, capture=head.capture_layers).layers)
        full_state, full_logits = head(fused[:, :-1], ids[:, 1:], None, target.embed)
        cache = AppendCache()
        steps = [head(fused[:, s:e], ids[:, s + 1 : e + 1], positions(s, e), target.embed, cache) for s, e in CHUNKS]
    torch.testing.assert_close(torch.cat([st for st, _ in steps], 1), full_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([lg for _, lg in steps], 1), full_logits, atol=1e-5, rtol=0)
    assert sorted(cache.k) == [4] and cache.k[4].shape[2] == T - 1


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("engine_cache,use_kernels", [(False, False), (True, True), (True, False)],
                         ids=["test-cache", "engine-kernels", "engine-torch-ops"])
def test_store_writes_the_keys_and_values_state_writes(kind, engine_cache, use_kernels):
    """A drafter catching up runs `store` on the rows whose states nobody reads (`proposers.hidden`): it must leave
    in the cache what `state` leaves, through a test cache, and through the engine's slotted cache with the CPU
    kernels and with torch's ops (as on a GPU) alike; a store that skipped a norm, the rotary or the embedding half
    would be off by whole units. The same products summed over the same 2H or H inputs, though perhaps blocked
    differently for the rows of one call: fp32 rounding of a 64-term sum, far under 1e-5."""
    target = make_target()
    head = make_drafter(kind, target)
    ids = token_ids()
    context = torch.inference_mode() if engine_cache else torch.no_grad()
    with context, contextlib.nullcontext() if use_kernels else kernels.disabled():
        hidden = target.trunk(ids).hidden if kind == "mtp" else head.fuse(
            target.trunk(ids, capture=head.capture_layers).layers)
        layer = target.config.num_hidden_layers
        written = []
        for write in (head.state, head.store):
            if engine_cache:
                cfg = target.config
                cache = KVCache(head.num_cache_layers, B, T, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                                torch.device("cpu"), first_layer=layer)
                view = cache.view(list(range(B)), [0] * B, T - 1)
                write(hidden[:, :-1], ids[:, 1:], view.positions, target.embed, view)
                written.append([t[:, :, :, : T - 1] if i == 0 else t[:, :, : T - 1] for i, t in
                                enumerate(view.layer_cache(layer))])
            else:
                cache = AppendCache()
                write(hidden[:, :-1], ids[:, 1:], positions(0, T - 1), target.embed, cache)
                written.append([cache.k[layer], cache.v[layer]])
    for got, want in zip(written[1], written[0]):
        assert got.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ gradient isolation

@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_drafter_loss_never_reaches_the_trunk(kind):
    target = make_target()
    target.train()
    drafter = make_drafter(kind, target)
    ids = token_ids()
    # Trunk run with autograd on, as in a training step; the drafter reads detached hidden states (MTP) or
    # detaches them itself (EAGLE-3's fuse), and must detach the shared embedding and head on its own.
    loss = sum(
        F.cross_entropy(lg[:, :-1].flatten(0, 1), ids[:, i + 2 :].flatten())
        for i, lg in enumerate(draft_logits(kind, drafter, target, ids))
    )
    loss.backward()
    assert [n for n, p in target.named_parameters() if p.grad is not None] == []
    no_grad = [n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []
