"""`backend.megatron`'s speed settings (MoE dispatcher, grouped GEMM, fusions, recompute) resolved into Megatron's
`TransformerConfig` fields, and refused before anything is built where the machine cannot run them."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from megatron_spec.trainers.megatron.checks import Parallelism  # noqa: E402
from megatron_spec.trainers.megatron.provider import PORTABLE, Speed, speed_overrides, transformer_config
from megatron_spec.rl.backend_config import MegatronSection  # noqa: E402

from .common import tiny  # noqa: E402

FAST = dict(moe_grouped_gemm=True, moe_permute_fusion=True, bias_activation_fusion=True, apply_rope_fusion=True,
            masked_softmax_fusion=True, moe_token_dispatcher_type="alltoall")
OFF = dict(moe_grouped_gemm=False, moe_permute_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
           masked_softmax_fusion=False, moe_token_dispatcher_type="allgather")


def test_section_defaults_resolve_per_machine():
    """The section's defaults: everything fast on CUDA with Transformer Engine, everything off with the allgather
    dispatcher on a CPU; a dense model gets no dispatcher and no MoE fusions."""
    auto = Speed.from_section(MegatronSection())
    assert speed_overrides(auto, moe=True, cuda=True, te=True) == FAST
    assert speed_overrides(auto, moe=True, cuda=False, te=False) == OFF
    dense = {k: v for k, v in FAST.items() if k != "moe_token_dispatcher_type"}
    assert speed_overrides(auto, moe=False, cuda=True, te=True) == {**dense, "moe_grouped_gemm": False,
                                                                   "moe_permute_fusion": False}
    assert speed_overrides(PORTABLE, moe=True, cuda=True, te=False) == OFF


def test_gpu_defaults_without_transformer_engine_are_refused_naming_the_extra():
    with pytest.raises(ValueError, match=r"moe_grouped_gemm, moe_permute_fusion, fusions need Transformer Engine: "
                                         r"pip install 'megatron-spec\[te\]'"):
        speed_overrides(Speed(), moe=True, cuda=True, te=False)
    # turning them off is the other way out; the alltoall dispatcher itself needs only CUDA
    ok = speed_overrides(Speed(moe_grouped_gemm=False, moe_permute_fusion=False, fusions=False), moe=True,
                         cuda=True, te=False)
    assert ok["moe_token_dispatcher_type"] == "alltoall" and not ok["moe_grouped_gemm"]


@pytest.mark.parametrize("field, value", [("moe_grouped_gemm", True), ("fusions", True),
                                          ("moe_token_dispatcher", "alltoall")])
def test_gpu_settings_on_a_cpu_are_refused(field, value):
    with pytest.raises(ValueError, match="needs? CUDA"):
        speed_overrides(Speed(**{field: value}), moe=True, cuda=False, te=False)


def test_recompute_details_reach_megatron():
    """Full recompute by blocks of 2 layers and selective recompute of the MoE layers, as TransformerConfig
    takes them (it validates them itself on construction)."""
    full = speed_overrides(Speed(recompute="full", recompute_method="block", recompute_num_layers=2), moe=True,
                           cuda=False, te=False)
    assert {k: full[k] for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")} == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
    sel = speed_overrides(Speed(recompute="selective", recompute_modules=("core_attn", "moe")), moe=True,
                          cuda=False, te=False)
    config = transformer_config(tiny("moe"), Parallelism(), **sel)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["core_attn", "moe"])
    assert "recompute_granularity" not in speed_overrides(Speed(), moe=True, cuda=False, te=False)


@pytest.mark.parametrize("kw, message", [
    (dict(moe_token_dispatcher="flex"), "moe_token_dispatcher must be one of auto, allgather, alltoall"),
    (dict(recompute="selective", recompute_modules=("attention",)), "unknown attention"),
    (dict(recompute_modules=("moe",)), "recompute_modules applies to recompute=selective"),
    (dict(recompute_method="every"), "recompute_method must be one of uniform, block"),
    (dict(recompute_num_layers=0), "recompute_num_layers must be >= 1"),
])
def test_section_refuses_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        MegatronSection(**kw)
