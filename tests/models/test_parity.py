"""Our model code against HF transformers on tiny random configs saved by transformers itself."""

import json

import pytest
import torch

from megatron_spec.models import CausalLM, ModelConfig, from_pretrained, preset, save_pretrained

transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e .[test])")

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def hf_models():
    return {
        "qwen3": transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**TINY, intermediate_size=128, head_dim=16, rope_theta=1e6)),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
        "qwen3_moe_unnormed": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
        "llama": transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**TINY, intermediate_size=128, tie_word_embeddings=True, rope_theta=1e5)),
    }


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_moe_unnormed", "llama"])
def test_logits_match_hf(family, tmp_path):
    """fp32 logits agree with HF's within 1e-4 for every family (same checkpoint, ragged token ids)."""
    torch.manual_seed(1)
    hf = hf_models()[family].eval()
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    ids = torch.randint(0, 96, (3, 23))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff < 1e-4


def test_save_roundtrip_loads_in_hf(tmp_path):
    """A checkpoint we save is read by transformers and gives the same logits (our layout is HF's)."""
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-draft"])
def test_checkpoint_roundtrip_identical_logits(name, tmp_path):
    model = CausalLM(preset(name)).eval()
    save_pretrained(model, tmp_path / "ckpt")
    again = from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))


def test_sharded_checkpoint_roundtrip_and_missing_shard(tmp_path):
    model = CausalLM(preset("tiny-qwen3")).eval()
    save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=400_000)
    shards = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))
    assert len(shards) >= 3
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids), from_pretrained(tmp_path / "ckpt")(ids))
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"partial.*{shards[1].name}"):
        from_pretrained(tmp_path / "ckpt")


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "empty")
    model = CausalLM(preset("tiny-qwen3"))
    save_pretrained(model, tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt5"}))
    with pytest.raises(ValueError, match="unknown model_type 'gpt5'"):
        from_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match="missing tensor"):
        from_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    with pytest.raises(ValueError, match="shape mismatch"):
        from_pretrained(tmp_path / "ok")
    (tmp_path / "ok" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        from_pretrained(tmp_path / "ok")


def test_interrupted_save_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous checkpoint loadable and unchanged."""
    import megatron_spec.models.hf_io as hf_io

    model = CausalLM(preset("tiny-draft")).eval()
    save_pretrained(model, tmp_path / "ckpt")
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        before = model(ids)
    monkeypatch.setattr(hf_io, "save_tensors", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(CausalLM(preset("tiny-draft")), tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "ckpt")(ids), before)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_config_validation():
    with pytest.raises(ValueError, match="unknown model_type"):
        ModelConfig.from_hf({"model_type": "mamba"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=3,
                    num_key_value_heads=2, intermediate_size=8)
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def test_moe_aux_loss_is_one_when_balanced():
    """The load-balancing loss E * sum f_e P_e equals 1 for a uniform router (zero gate weights) and exceeds it
    when the router prefers some experts."""
    model = CausalLM(preset("tiny-qwen3-moe"))
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)
    model(torch.randint(0, 64, (2, 16)))
    n_layers = model.config.num_hidden_layers
    assert model.aux_loss.item() == pytest.approx(n_layers, abs=1e-5)
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0)
    model(torch.randint(0, 64, (2, 16)))
    assert model.aux_loss.item() > n_layers * 1.01
