"""Tuner (issue part 5): highest tokens trained per second per GPU among configurations that fit."""

import pytest

from megatron_spec.sim import LengthDist, SimConfig, Speculation, TrainParallel, Workload
from megatron_spec.sim.memory import fits, memory_report
from megatron_spec.sim.pipeline import build, simulate
from megatron_spec.sim.tune import (TuneSpace, best_layout, format_rejections, format_table, plot, recipe_defaults,
                                    search, tune)

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


def test_rejections_are_counted_by_reason(base):
    """Every configuration left out is counted under its reason, exactly: with TP 3 allowed on 8 GPUs, one
    colocated placement and trainer layouts TP 1/2/3 x PP 1, TP 3 is refused once (8 % 3), and one of the two
    valid training layouts is dropped as the slower one for the same GPU share. The engine TP 1/2/4 x 7
    speculation variants (none, and k 2/3/5 each with the controller off or on) all run colocated (the Ray
    placement gives each engine worker a GPU of its own beside a trainer rank): the 21 are ranked or counted as a
    k the controller never uses, and an engine of TP 4 ranks first."""
    space = TuneSpace(gen_tp=(1, 2, 4), train_tp=(1, 2, 3), train_pp=(1,), train_cp=(1,), ks=(0, 2, 3, 5),
                      adaptive=("off", "auto"), lags=(0,))
    result = search(base, space)
    assert result.rejected.example == {
        "train tp*pp*cp=# does not divide the # training GPUs": "train tp*pp*cp=3 does not divide the 8 training GPUs",
        "a slower training layout for the same GPU share": "a slower training layout for the same GPU share",
        **({"a larger k the controller never uses (same step as a smaller one)":
            "a larger k the controller never uses (same step as a smaller one)"}
           if len(result.ranked) < 21 else {}),
    }
    assert result.rejected["train tp*pp*cp=# does not divide the # training GPUs"] == 1
    assert result.rejected["a slower training layout for the same GPU share"] == 1
    assert {c.cfg.gen.tp for c in result.ranked} == {1, 2, 4} and result.ranked[0].cfg.gen.tp == 4
    assert result.ranked[0].cfg.colocated
    assert len(result.ranked) + result.rejected.get(
        "a larger k the controller never uses (same step as a smaller one)", 0) == 21
    lines = format_rejections(result.rejected).splitlines()
    counts = [int(line.split(" x ")[0]) for line in lines]
    assert counts == sorted(counts, reverse=True) and sum(counts) == sum(result.rejected.values())


def test_methods_are_searched_and_checked(base):
    """Each drafter method is tried at the same acceptance: an MTP module (a full target layer) costs more per
    draft than an EAGLE-3 head (one layer over a 32k vocabulary), so at equal acceptance EAGLE-3 ranks first; an
    unknown method is refused before any simulation."""
    space = TuneSpace(gen_tp=(1,), train_tp=(1,), train_pp=(1,), train_cp=(1,), ks=(3,), adaptive=("off",),
                      lags=(0,), methods=("mtp", "eagle3"))
    ranked = search(base, space).ranked
    methods = [c.settings()["method"] for c in ranked]
    assert sorted(methods) == ["eagle3", "mtp", "none"]
    assert methods.index("eagle3") < methods.index("mtp")
    with pytest.raises(ValueError, match="unknown drafter method 'medusa'"):
        search(base, TuneSpace(methods=("medusa",)))


def test_best_layout_235b_passes_the_shared_validator():
    """`best_layout` for Qwen3-235B-A22B on 128 H100 (a narrowed space, so the suite stays fast: engines of TP 8
    on a quarter of the GPUs at lag 2, the recipe's placement; colocated, TP 8 engines are refused): its trainer
    layout passes `megatron_spec.layout.check_layout` on the training GPUs with Megatron's uneven stages (94 layers),
    the backend overrides spell that layout, and the predicted stage times are `simulate`'s for the chosen
    configuration (same numbers, not a second model)."""
    from megatron_spec.layout import check_layout, stage_layers
    from megatron_spec.models.presets import preset

    space = TuneSpace(gen_tp=(8,), train_tp=(1, 2), train_pp=(4, 8), train_cp=(1, 2), train_ep=(4, 8),
                      ks=(3,), adaptive=("off",), lags=(2,), gen_fractions=(0.25,))
    spec = Speculation(k=3, acceptance_length=2.8, drafter="mtp")
    layout, stages = best_layout("qwen3-235b-a22b", 128, "h100", spec=spec, space=space, gen_dtype_bytes=1)
    m = preset("qwen3-235b-a22b")
    train_gpus = 128 if layout.placement == "colocated" else 128 - layout.gen_gpus
    check_layout(m, layout.train, world=train_gpus)
    assert sum(stage_layers(94, layout.train.pp, layout.train.first_stage_layers,
                            layout.train.last_stage_layers)) == 94
    t = layout.train
    assert layout.train_dp * t.tp * t.pp * t.cp == train_gpus and layout.engines * layout.gen_tp == layout.gen_gpus
    o = layout.backend_overrides()
    assert (o["backend.megatron.tp"], o["backend.megatron.pp"], o["backend.megatron.ep"]) == (t.tp, t.pp, t.ep)
    assert o["backend.megatron.sequence_parallel"] == (t.tp > 1)  # Megatron-Core's rule for MoE under TP
    assert (layout.placement, layout.gen_gpus, layout.async_lag) == ("disaggregated", 32, 2)
    cfg = SimConfig(model="qwen3-235b-a22b", hardware="h100", gpus=128, gen_dtype_bytes=1, colocated=False,
                    gen_gpus=layout.gen_gpus, policy_lag=layout.async_lag,
                    workload=__import__("megatron_spec.sim.projection", fromlist=["x"]).projection_workload(),
                    train=TrainParallel(tp=t.tp, pp=t.pp, ep=t.ep, cp=t.cp, dp=layout.train_dp),
                    gen=__import__("megatron_spec.sim", fromlist=["x"]).GenParallel(tp=layout.gen_tp, ep=layout.gen_ep),
                    spec=Speculation(k=layout.k, acceptance_length=2.8, drafter=layout.method),
                    moe_dispatcher=layout.moe_dispatcher)
    assert o["backend.megatron.moe_token_dispatcher"] == layout.moe_dispatcher == (
        "allgather" if t.ep < 8 else "alltoall")  # Qwen3-235B-A22B routes to 8 experts
    again = simulate(cfg)
    assert stages == pytest.approx({**again.stages, "step": again.step_s}, rel=1e-12)


def test_a_per_position_profile_prices_each_k():
    """Given a drafter's per-position acceptance (the paper's RL-Think EAGLE-3 profile: 0.758 x3, 0.642 x2,
    0.781 x2), the tuner drafts each k with that profile's first k positions, so its acceptance length at k is the
    measured one (2.77 at 3, 3.23 at 5), not the constant-rate re-expansion of the profile's k=7 figure (which
    would put k=3 at 2.68); past the profile it falls back to the constant rate."""
    from megatron_spec.sim.acceptance import tau_from_rate
    from megatron_spec.sim.reference import drafter_profile
    from megatron_spec.sim.tune import _spec_variants

    profile = drafter_profile("think")
    spec = Speculation(k=7, per_position=profile)
    space = TuneSpace(ks=(0, 3, 5, 7), adaptive=("off",))
    taus = {s.k: s.tau(s.k) for s in _spec_variants(space, spec) if s is not None}
    assert {k: round(t, 2) for k, t in taus.items()} == {3: 2.77, 5: 3.23, 7: 3.48}
    assert round(tau_from_rate(spec.rate, 3), 2) == 2.68
    wide = TuneSpace(ks=(8,), adaptive=("off",))
    (deep,) = [s for s in _spec_variants(wide, Speculation(k=3, per_position=profile[:3])) if s is not None]
    assert deep.per_position == () and deep.tau(8) == pytest.approx(tau_from_rate(Speculation(
        k=3, per_position=profile[:3]).rate, 8))
