"""Bad input: parallel sizes that do not divide the model and mismatched configs fail with messages that name the
mismatch. Pure (no megatron-core). The layout rules themselves are `megatron_spec.layout`'s (tests/test_layout.py)."""

from __future__ import annotations

import pytest

from megatron_spec.trainers.megatron.checks import Parallelism, check_config_match, check_parallelism

from .common import tiny


def test_valid_splits_pass():
    check_parallelism(tiny("dense"), Parallelism(tp=2, pp=2), world_size=4)
    check_parallelism(tiny("moe"), Parallelism(tp=2, ep=4, etp=1), world_size=4)


@pytest.mark.parametrize(
    "cfg, par, world, message",
    [
        (tiny("dense", num_attention_heads=6, num_key_value_heads=3, head_dim=16), Parallelism(tp=4), None,
         "tp=4 does not divide num_attention_heads=6"),
        (tiny("dense", num_key_value_heads=1), Parallelism(tp=2), None,
         r"tp=2 does not divide the query groups \(num_key_value_heads=1\)"),
        (tiny("moe"), Parallelism(ep=3), None, "ep=3 does not divide num_experts=4"),
        (tiny("moe", moe_intermediate_size=30), Parallelism(tp=4, etp=4), None, "etp=4 does not divide moe_intermediate_size=30"),
        (tiny("dense"), Parallelism(ep=2), None, "ep=2 needs an MoE model"),
        (tiny("dense"), Parallelism(pp=3), None, "pp=3 exceeds num_hidden_layers=2"),
        (tiny("dense", num_hidden_layers=5), Parallelism(pp=2), None,
         "pp=2 does not divide the 5 layer.*accepts first/last stage layers \\(3, 2\\)"),
        (tiny("dense"), Parallelism(tp=2), 3, r"TP\*PP\*CP = 2 does not divide the 3 devices"),
        (tiny("moe"), Parallelism(tp=2, ep=2), 2, r"EP\*PP = 2 \(x ETP 2\) does not divide the 2 devices.*etp=1"),
        (tiny("dense", attention_bias=True), Parallelism(), None, "attention_bias=True is not supported"),
    ],
)
def test_bad_splits_name_the_mismatch(cfg, par, world, message):
    with pytest.raises(ValueError, match=message):
        check_parallelism(cfg, par, world)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        Parallelism(tp=0)


def test_config_mismatch_lists_every_field():
    with pytest.raises(ValueError) as e:
        check_config_match(tiny("dense", hidden_size=128, num_key_value_heads=4), tiny("dense"), where="checkpoint /x")
    msg = str(e.value)
    assert "checkpoint /x config does not match the requested architecture" in msg
    assert "hidden_size: checkpoint /x 128 != requested 64" in msg and "num_key_value_heads" in msg
    with pytest.raises(ValueError, match="model_type: checkpoint 'qwen3_moe' != requested 'qwen3'"):
        check_config_match(tiny("moe"), tiny("dense"))
    check_config_match(tiny("moe"), tiny("moe"))
