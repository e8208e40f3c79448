"""The memory audit's activation term under each recompute setting (`launchers/audit.py`)."""

from types import SimpleNamespace

import pytest

from launchers.audit import layer_activation_bytes, stage_activation_bytes
from megatron_spec.models import ModelConfig

MOE = ModelConfig(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, qk_norm=True)


def meg(recompute="none", **kw):
    return SimpleNamespace(recompute=recompute, sequence_parallel=False, recompute_method=kw.get("method", "uniform"),
                           recompute_num_layers=kw.get("n", 1), recompute_modules=kw.get("modules", ()))


def test_selective_modules_drop_what_they_recompute():
    """Per token, fp32 (4 B), TP1, hidden 64, q 64, kv 32, top-2 experts of width 32, 8 experts: attention keeps
    input + norm out + qkv, normed q/k, rotated output (64 + 64 + 128 + 96 + 64 = 416 values); the MoE MLP keeps
    input + norm out + 2 x (2 x 64 + 4 x 32) + 8 x 2 router values (656). `moe` keeps its input and the router's
    (64 + 16), `moe_act` halves the experts' inner terms (2 x (128 + 64)), `layernorm` drops both norm outputs."""
    none = layer_activation_bytes(MOE, 0, "none", 1, False, 4)
    assert none == (416 + 656) * 4
    assert layer_activation_bytes(MOE, 0, "selective", 1, False, 4, ("core_attn",)) == none
    assert layer_activation_bytes(MOE, 0, "selective", 1, False, 4, ("moe",)) == (416 + 80) * 4
    assert layer_activation_bytes(MOE, 0, "selective", 1, False, 4, ("moe_act",)) == (416 + 656 - 128) * 4
    assert layer_activation_bytes(MOE, 0, "selective", 1, False, 4, ("layernorm",)) == (416 + 656 - 128) * 4
    assert layer_activation_bytes(MOE, 0, "none", 1, False, 4, ("moe",)) == none  # modules only under selective


def test_full_recompute_methods():
    """4 layers of 1072 values kept each without recompute; full uniform by 1: 4 inputs (64 each) kept and one
    layer rerun; uniform by 2: 2 chunk inputs kept and 2 layers rerun; block 1: layer 0 keeps its input, the other
    3 everything, one layer rerun."""
    layers, one = range(4), 1072 * 4
    assert stage_activation_bytes(MOE, layers, meg(), 1, 4) == (4 * one, 0.0)
    assert stage_activation_bytes(MOE, layers, meg("full"), 1, 4) == (4 * 64 * 4, one)
    assert stage_activation_bytes(MOE, layers, meg("full", n=2), 1, 4) == (2 * 64 * 4, 2 * one)
    assert stage_activation_bytes(MOE, layers, meg("full", method="block"), 1, 4) == (64 * 4 + 3 * one, one)


@pytest.mark.parametrize("modules, saved", [(("moe",), 656 - 80), (("layernorm", "moe"), 656 - 80 + 64)])
def test_selective_moe_recompute_shrinks_the_stage(modules, saved):
    kept, rerun = stage_activation_bytes(MOE, range(2), meg("selective", modules=modules), 1, 4)
    assert (kept, rerun) == (2 * (1072 - saved) * 4, 0.0)
