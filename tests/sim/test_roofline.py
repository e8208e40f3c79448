"""The per-forward roofline against hand-computed figures from the spec sheets and the calibration constants."""

import pytest

from megatron_spec.models.presets import preset
from megatron_spec.sim.calibration import GPU
from megatron_spec.sim.hardware import GPU_PROFILES
from megatron_spec.sim.roofline import forward_time, linear_time
from megatron_spec.sim.shapes import drafter_shape, shape_of

H100 = GPU_PROFILES["h100"]
Q8 = shape_of(preset("qwen3-8b"))
Q235 = shape_of(preset("qwen3-235b-a22b"))


def test_parameter_counts_match_the_model_names():
    """Qwen3-8B has 8.2B parameters (incl. embeddings), Qwen3-235B-A22B 235B total / 22B active, SmolLM2 135M."""
    assert Q8.total_params == pytest.approx(8.19e9, rel=0.01)
    assert Q235.total_params == pytest.approx(235e9, rel=0.01)
    assert Q235.active_params + Q235.embed_params == pytest.approx(22e9, rel=0.03)
    assert shape_of(preset("smollm2-135m")).total_params == pytest.approx(134.5e6, rel=0.01)


def test_eagle3_head_is_about_five_percent_of_qwen3_8b():
    """One decoder layer with 2H-wide q/k/v (~210M), fc 3H->H (50M), 32k x 4096 head (131M): ~0.4B, ~5 % of 8B."""
    d = drafter_shape(preset("qwen3-8b"), "eagle3")
    assert d.total_params == pytest.approx(0.40e9, rel=0.02)
    assert d.kv_bytes_per_token == pytest.approx(Q8.kv_bytes_per_token / 36)


def test_decode_at_batch_one_is_weight_bandwidth_bound():
    """8B BF16 decode on one H100: 15.1 GB of matmul weights at 80 % of 3.35 TB/s = 5.65 ms, plus the 1.5 ms
    forward overhead and a negligible sampler; no KV (empty context)."""
    expect = Q8.dense_params * 2 / (3.35e12 * 0.8) + GPU.forward_overhead_s
    assert forward_time(Q8, H100, GPU, 1, 1, 0) == pytest.approx(expect, rel=0.01)


def test_verify_is_free_at_small_batch_and_costs_k_plus_one_at_large_batch():
    """At 8 sequences, 4 verify tokens each are still under the ridge (~220 tokens on H100 with these
    efficiencies: 5.65 ms of weights / 25.5 us of arithmetic per token), so verify costs the same as decode. At
    2048 sequences both are compute-bound and the linear layers cost exactly 4x."""
    small = linear_time(Q8, H100, GPU, 8 * 4, 1, 2) / linear_time(Q8, H100, GPU, 8, 1, 2)
    large = linear_time(Q8, H100, GPU, 2048 * 4, 1, 2) / linear_time(Q8, H100, GPU, 2048, 1, 2)
    assert small == pytest.approx(1.0)
    assert large == pytest.approx(4.0)


def test_moe_verify_touches_more_experts():
    """Top-8 of 128 experts: one token reads 8 experts per layer, 4 tokens ~29.5, 64 tokens ~126 of 128."""
    assert Q235.experts_touched(1) == pytest.approx(8)
    assert Q235.experts_touched(4) == pytest.approx(128 * (1 - (120 / 128) ** 4))
    assert Q235.experts_touched(64) > 125
    assert linear_time(Q235, H100, GPU, 4, 8, 1) > 2 * linear_time(Q235, H100, GPU, 1, 8, 1)


def test_tensor_parallel_splits_weights_and_adds_all_reduces():
    """TP8 reads 1/8 of the weights per GPU but pays 2 all-reduces per layer (72 x 10 us latency at least)."""
    t1 = forward_time(Q8, H100, GPU, 1, 1, 0, tp=1)
    t8 = forward_time(Q8, H100, GPU, 1, 1, 0, tp=8)
    weights_8 = Q8.dense_params * 2 / 8 / (3.35e12 * 0.8)
    assert t8 == pytest.approx(weights_8 + GPU.forward_overhead_s + 72 * GPU.collective_latency_s, rel=0.02)
    assert t8 < t1


def test_kv_cache_read_is_shared_by_verify_queries():
    """Attention over 1M context tokens: KV bytes are read once whether 1 or 4 queries per sequence attend."""
    ctx = 1e6
    kv_s = ctx * Q8.kv_bytes_per_token / (3.35e12 * 0.8)
    t1 = forward_time(Q8, H100, GPU, 64, 1, ctx) - forward_time(Q8, H100, GPU, 64, 1, 0)
    t4 = forward_time(Q8, H100, GPU, 64, 4, ctx) - forward_time(Q8, H100, GPU, 64, 4, 0)
    assert t1 == pytest.approx(kv_s, rel=1e-6)
    assert t4 == pytest.approx(kv_s, rel=1e-6)
