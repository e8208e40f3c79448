"""Tuner (issue part 5): highest tokens trained per second per GPU among configurations that fit."""

import pytest

from megatron_spec.sim import LengthDist, SimConfig, Speculation, TrainParallel, Workload
from megatron_spec.sim.memory import fits, memory_report
from megatron_spec.sim.pipeline import build, simulate
from megatron_spec.sim.tune import TuneSpace, format_table, plot, recipe_defaults, tune

W = Workload(prompts_per_step=64, group_size=8, prompt_len=200, response=LengthDist(mean=1500, max_tokens=8192))
SPACE = TuneSpace(gen_tp=(1, 2, 4), train_tp=(1, 2, 4), train_pp=(1, 2), train_cp=(1,), ks=(0, 2, 3, 5),
                  adaptive=("off", "auto"), lags=(0, 1), gen_fractions=(0.5,))


@pytest.fixture(scope="module")
def base():
    return SimConfig(model="qwen3-8b", hardware="h100", gpus=8, workload=W, train=TrainParallel(dp=8),
                     spec=Speculation(k=3, acceptance_length=2.8))


@pytest.fixture(scope="module")
def top(base):
    return tune(base, SPACE, top=8)


def test_top_configurations_fit_and_are_sorted(top):
    """Every candidate passes the memory check and the list is sorted by throughput."""
    assert len(top) == 8
    for c in top:
        hw, _, target, drafter = build(c.cfg)
        assert fits(c.cfg, memory_report(c.cfg, hw, target, drafter))
    thr = [c.throughput for c in top]
    assert thr == sorted(thr, reverse=True)


def test_best_beats_the_naive_layout(base, top):
    """The tuner's best is at least as fast as the colocated, TP1-engine, k=3 starting point, and its reported
    throughput is what `simulate` gives for its configuration."""
    naive = simulate(base)
    assert top[0].throughput >= naive.throughput
    assert simulate(top[0].cfg).throughput == pytest.approx(top[0].throughput, rel=1e-9)


def test_recipe_defaults_and_outputs(base, tmp_path):
    d = recipe_defaults(base, SPACE)
    for key in ("train_tp", "train_pp", "train_dp", "gen_tp", "k", "adaptive", "policy_lag", "tokens_per_s_per_gpu"):
        assert key in d
    table = format_table(tune(base, SPACE, top=3))
    assert table.count("\n") == 3
    png = plot(tune(base, SPACE, top=3), str(tmp_path / "top.png"))
    assert (tmp_path / "top.png").stat().st_size > 1000 and png.endswith("top.png")


def test_nothing_fits():
    """Qwen3-235B-A22B cannot be trained on 8 H100 whatever the layout."""
    big = SimConfig(model="qwen3-235b-a22b", hardware="h100", gpus=8, workload=W, train=TrainParallel(dp=8))
    with pytest.raises(ValueError, match="fits in memory"):
        tune(big, TuneSpace(gen_tp=(8,), train_tp=(8,), train_pp=(1,), train_cp=(1,), train_ep=(8,), ks=(0,)))
