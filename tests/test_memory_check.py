"""The pre-launch memory check (`launchers.checks.memory_problems`: the memory audit's problems) and the
simulator's memory per GPU (`memory_per_gpu`), before anything is submitted."""

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


def test_the_launch_check_is_the_audit():
    """The memory check before launch is the audit's (`launchers/audit.py`): the 8B recipe fits an H100 with the
    distributed optimizer (the recipe's), not with torch AdamW's unsharded states, and the problem names the fix;
    the 235B recipe as shipped fits, and at EP4 (7.25 B expert parameters a stage) it does not."""
    cfg, layout = plan(r8, "qwen3_8b_grpo_spec")
    cfg.backend.megatron.optimizer = "megatron"
    assert memory_problems(cfg, layout) == []
    cfg.backend.megatron.optimizer = "torch"
    (problem,) = memory_problems(cfg, layout)
    assert problem.startswith("memory audit (h100): trainer stage 0 (36 layers): ")
    assert "set backend.megatron.optimizer=megatron" in problem
    cfg, layout = plan(r235, "qwen3_235b_grpo_spec")
    assert memory_problems(cfg, layout) == []
    cfg.backend.megatron.ep = 4
    problems = memory_problems(cfg, layout)
    assert len(problems) == 8 and all("colocate trainer and engines" in p for p in problems)  # every stage


def test_a_layout_that_cannot_fit_is_refused_before_launch():
    """235B without model parallelism: every GPU would hold all 235B parameters (2 B of bf16 weights and 4 B of fp32
    gradients each: over 1.4 TB) against 80 GB; a dry run (`inputs=False`) returns the audit's problem to print, a
    launch raises with it."""
    cfg, layout = plan(r235, "qwen3_235b_grpo_spec", tp=1, pp=1, ep=1, first_stage_layers=None,
                       last_stage_layers=None)
    cfg.backend.megatron.tp = cfg.backend.megatron.pp = cfg.backend.megatron.ep = 1
    cfg.backend.megatron.sequence_parallel = False
    cfg.backend.megatron.first_stage_layers = cfg.backend.megatron.last_stage_layers = None
    problems = [p for p in memory_problems(cfg, layout) if "trainer stage" in p]
    assert len(problems) == 1 and problems[0].startswith("memory audit (h100): trainer stage 0 (94 layers): ")
    per_gpu = float(problems[0].split("(94 layers): ")[1].split(" GB")[0])
    assert per_gpu > 235e9 * 6 / 1e9  # at least weights + gradients of the whole model
    assert problems[0] in check_launch("qwen3_235b_grpo_spec", cfg, layout, driver=None, inputs=False)


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
