"""The pre-launch memory check (`launchers.checks.memory_problems`): the simulator's memory per GPU of the
trainer's split and of one engine against the GPU's memory, before anything is submitted."""

from __future__ import annotations

import copy

import pytest

from launchers.checks import check_launch, memory_problems
from recipes import qwen3_235b_grpo_spec as r235
from recipes import qwen3_8b_grpo_spec as r8


def plan(recipe, name, **megatron):
    cfg = getattr(recipe, name)()
    layout = copy.deepcopy(recipe.SCALE.layout(cfg))
    layout.update(nodes=recipe.SCALE.nodes, gpus_per_node=recipe.SCALE.gpus_per_node)  # as the plan recommends
    layout["megatron"].update(megatron)
    return cfg, layout


@pytest.mark.parametrize("recipe, name", [(r235, "qwen3_235b_grpo_spec"), (r8, "qwen3_8b_grpo_spec")])
def test_shipped_recipes_fit_an_h100(recipe, name):
    cfg, layout = plan(recipe, name)
    assert memory_problems(cfg, layout) == []


def test_a_layout_that_cannot_fit_is_refused_before_launch():
    """235B without model parallelism: every GPU would hold all 235B parameters (6 B each for bf16 weights and
    fp32 gradients: ~1.3 TiB) against 80 GB; the check names the trainer and the figure, and `check_launch`
    raises with it."""
    cfg, layout = plan(r235, "qwen3_235b_grpo_spec", tp=1, pp=1, ep=1, first_stage_layers=None,
                       last_stage_layers=None)
    problems = memory_problems(cfg, layout)
    assert len(problems) == 1 and "trainer does not fit in memory" in problems[0]
    per_gpu = float(problems[0].split("trainer does not fit in memory: ")[1].split(" GiB")[0])
    assert per_gpu > 235e9 * 6 / 2**30  # at least weights + gradients of the whole model
    with pytest.raises(ValueError, match="memory per h100 GPU"):
        check_launch("qwen3_235b_grpo_spec", cfg, layout, driver=None, inputs=False)


def test_precision_and_recompute_reach_the_estimate():
    """The 8B recipe's split: fp32 parameters cost 8 B of weights + gradients per local parameter instead of 6 B
    and 8 B of optimizer state per parameter over data parallel instead of 12 B (no separate masters); keeping
    every activation (`recompute=none`) needs more than selective recompute; the engine side does not move."""
    from launchers.checks import memory_per_gpu

    cfg, layout = plan(r8, "qwen3_8b_grpo_spec")
    figures = {}
    for dtype, recompute in (("bfloat16", "selective"), ("float32", "selective"), ("bfloat16", "none")):
        cfg.backend.megatron.params_dtype, cfg.backend.megatron.recompute = dtype, recompute
        figures[dtype, recompute] = memory_per_gpu(cfg, layout)[1]
    bf16, fp32, keep = figures["bfloat16", "selective"], figures["float32", "selective"], figures["bfloat16", "none"]
    assert fp32.train_weights == pytest.approx(bf16.train_weights * 8 / 6)
    assert fp32.train_optimizer == pytest.approx(bf16.train_optimizer * 8 / 12)
    assert fp32.train_total > bf16.train_total
    assert keep.train_activations > bf16.train_activations and keep.train_weights == bf16.train_weights
    assert fp32.engine_weights == bf16.engine_weights == keep.engine_weights
