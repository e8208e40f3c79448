"""The simulator against NeMo-RL's published H100 BF16 GRPO step times (megatron_spec/sim/data), with the one
Hopper calibration fitted on five of the rows (`sim/fit.py`) and checked on the other five."""

import json
import math
from dataclasses import replace

import pytest

from megatron_spec.cli import main
from megatron_spec.sim.calibration import HOPPER, HOPPER_FIT, calibration_for
from megatron_spec.sim.fit import FIT_ROWS, PARAMS, loss, with_params
from megatron_spec.sim.pipeline import build, simulate
from megatron_spec.sim.stages import grad_sync_time
from megatron_spec.sim.published import compare, config_for, response_for, row, rows

# simulated / published step time of every row with the committed calibration. A change to the model moves these:
# update them together with docs/design/simulator-calibration.md.
PINNED = {
    "llama3.1-8b sync": 0.9916, "llama3.1-8b 1-off": 1.0422, "qwen3-32b sync": 0.9417, "qwen3-32b 1-off": 1.0098,
    "qwen3-30b-a3b sync": 1.0235, "qwen3-30b-a3b 1-off": 0.9958, "qwen3-30b-a3b 8-off": 0.9518,
    "qwen3-235b sync 128": 0.9973, "qwen3-235b sync 256": 0.8868, "qwen3-235b 1-off": 1.0285,
}


@pytest.fixture(scope="module")
def table():
    return {c.name: c for c in compare()}


def test_every_row_within_fifteen_percent(table):
    """The issue's bar: every expressible H100 BF16 row within 15 % of its published step time, fitted rows and
    checked rows alike, with one calibration."""
    assert set(table) == set(PINNED)
    for name, c in table.items():
        assert 0.85 <= c.ratio <= 1.15, (name, c.ratio)


def test_ratios_are_pinned(table):
    """Each ratio to 0.2 %: far below the 15 % bar, so any change to the step model or the calibration shows."""
    for name, c in table.items():
        assert c.ratio == pytest.approx(PINNED[name], abs=2e-3), name


def test_checked_rows_are_not_fitted():
    """Half the rows check the fit: FIT_ROWS names five existing rows, the other five are out of sample."""
    names = {r["name"] for r in rows("h100")}
    assert set(FIT_ROWS) <= names and len(FIT_ROWS) == 5 and len(names - set(FIT_ROWS)) == 5


def test_committed_constants_are_a_local_minimum():
    """Moving any fitted parameter by 4 % either way (inside its bounds) does not lower the fit loss: the rounded
    constants in calibration.HOPPER_FIT are what `fit.fit_calibration` finds, not hand-set."""
    base = loss(HOPPER)
    assert base < 5 * 0.05 ** 2  # root-mean-square log-ratio under 5 % on the fitted rows
    for name, (lo, hi) in PARAMS.items():
        for f in (1.04, 1 / 1.04):
            value = min(max(HOPPER_FIT[name] * f, lo), hi)
            assert loss(with_params(HOPPER, {name: value})) >= base - 1e-9, (name, f)


def test_fitted_values_are_physical():
    """Decode at about half the roofline, per-forward overhead of ~1 ms, dense MFU near Megatron's published
    40 %, MoE MFU well below dense (fine-grained experts, token dispatch): each inside what public figures allow."""
    assert 0.3 < HOPPER.decode_eff < 0.8
    assert 5e-4 < HOPPER.forward_overhead_s < 3e-3
    assert 0.3 < HOPPER.train_mfu < 0.55
    assert 0.05 < HOPPER.train_mfu_moe < HOPPER.train_mfu
    assert calibration_for("h200") is HOPPER and calibration_for("gb200").decode_eff == 1.0


# The GB200 rows against the spec-sheet Blackwell set, which is not fitted on them: NeMo-RL's GB200 times are
# 1.3-5.5x the simulated ones and not self-consistent (more GPUs, slower steps), so no shared set fits them within
# 15 % (docs/design/simulator-calibration.md). Pinned so that the gap stays visible.
GB200_PINNED = {
    "llama3.1-8b sync": 0.53, "llama3.1-8b 1-off": 0.75, "qwen3-32b sync": 0.70, "qwen3-32b 1-off": 0.72,
    "qwen3-30b-a3b sync": 0.37, "qwen3-30b-a3b 1-off": 0.18, "qwen3-235b sync 64": 0.46,
    "qwen3-235b sync 128": 0.30, "qwen3-235b 1-off": 0.23,
}


def test_gb200_rows_show_the_blackwell_sets_optimism():
    comps = {c.name: c.ratio for c in compare(hardware="gb200")}
    assert set(comps) == set(GB200_PINNED)
    for name, ratio in comps.items():
        assert ratio == pytest.approx(GB200_PINNED[name], abs=0.01), name


def test_stage_parts_add_up(table):
    """Sync rows sum their stages; async rows are max(gen side, train side) + prepare."""
    for name, c in table.items():
        st, r = c.result.stages, row(name)
        if r["lag"] == 0:
            assert c.result.step_s == pytest.approx(sum(st.values()))
        else:
            train_side = st["data"] + st["logprob"] + st["train"]
            assert c.result.step_s == pytest.approx(max(st["gen"], train_side) + st["prepare"])


def test_response_lengths_match_the_table():
    """The length distribution's capped mean plus the prompt is the table's average sequence length."""
    dist = response_for(3203, 4096)
    assert dist.expected + 150 == pytest.approx(3203, rel=1e-4)
    assert dist.max_tokens == 4096 - 150
    with pytest.raises(ValueError, match="between the prompt"):
        response_for(4200, 4096)


def test_inputs_move_the_stages_they_describe():
    """Each new input changes its own stage by the amount its physics says."""
    r = row("llama3.1-8b sync")
    cfg = config_for(r)
    base = simulate(cfg)
    none = simulate(config_for(r, recompute="none"))
    # full recompute: 4 forwards instead of 3 (the gradient syncs, one per optimizer step, are the same in both)
    hw, cal, target, _ = build(cfg)
    sync = cfg.optimizer_steps * grad_sync_time(cfg, hw, cal, target)
    assert cfg.optimizer_steps == 4 and sync > 0
    assert (base.stages["train"] - sync) / (none.stages["train"] - sync) == pytest.approx(4 / 3, rel=0.01)
    no_ref = simulate(config_for(r, reference_logprob=False))
    assert no_ref.stages["logprob"] < 0.55 * base.stages["logprob"]  # one pass and no weight swap instead of two
    one_update = simulate(config_for(r, train_global_batch=0))
    assert one_update.stages["train"] < base.stages["train"]  # one pipeline fill and one grad sync, not four
    no_offload = simulate(config_for(r, offload=False))
    assert 1.0 < base.stages["prepare"] - no_offload.stages["prepare"] < 10.0
    fp8 = simulate(config_for(r, train_fp8=True))
    assert HOPPER.fp8_train_gain == 0.3  # 1.3x on compute; the gradient syncs stay
    assert base.stages["train"] / fp8.stages["train"] == pytest.approx(1.3, rel=0.05)
    slow = simulate(config_for(r, decode_eff=HOPPER.decode_eff / 2))
    assert 1.3 < slow.stages["gen"] / base.stages["gen"] < 2.0  # kernels take twice as long; overhead does not


def test_config_refuses_bad_inputs():
    r = row("llama3.1-8b sync")
    with pytest.raises(ValueError, match="recompute must be one of"):
        config_for(r, recompute="some")
    with pytest.raises(ValueError, match="must divide the step's 2048 rollouts"):
        config_for(r, train_global_batch=500)
    with pytest.raises(ValueError, match="decode_eff must be in"):
        config_for(r, decode_eff=1.5)
    with pytest.raises(ValueError, match="in_flight_updates needs an asynchronous run"):
        config_for(r, in_flight_updates=True)
    with pytest.raises(ValueError, match="offload describes colocated"):
        config_for(row("llama3.1-8b 1-off"), offload=True)


def test_compare_published_cli(capsys):
    rc = main(["simulate", "--compare-published"])
    out = capsys.readouterr().out
    assert rc == 0
    for name, ratio in PINNED.items():
        line = next(x for x in out.splitlines() if x.startswith(name))
        assert f"{ratio:.2f}" in line
    assert "not expressible" in out and "DeepSeek V3" in out
    # fitted and held-out rows summarised apart, each from the pinned ratios
    assert "fitted (5 rows): ratio 0.99-1.02, furthest qwen3-30b-a3b sync (+2%); 5 of 5 within 15 %" in out
    assert "held out (5 rows): ratio 0.89-1.04, furthest qwen3-235b sync 256 (-11%); 5 of 5 within 15 %" in out


def test_lag_sensitivity_of_in_flight_updates():
    """Streaming through refits can only help the gen side: lag + 1 steps in one stream amortise the drain."""
    r = row("qwen3-235b 1-off")
    stream = simulate(config_for(r)).stages["gen"]
    drain = simulate(config_for(r, in_flight_updates=False)).stages["gen"]
    assert stream < drain and math.isfinite(stream)
    assert replace(config_for(r), in_flight_updates=False).steps_in_flight == 1


def test_cli_flags_reach_the_config(capsys):
    """--recompute full adds a forward to train (4/3 of 'none' on compute), --reference-logprob a second logprob
    pass, --decode-eff slows gen: each flag lands in SimConfig."""
    argv = ["simulate", "--model", "qwen3-8b", "--hardware", "h100", "--gpus", "8", "--prompts", "64",
            "--mean-len", "1500", "--max-tokens", "4096", "--micro-batch-tokens", "2048", "--json"]

    def run(*extra):
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["stages"]

    base, full = run("--recompute", "none"), run("--recompute", "full")
    assert 1.25 < full["train"] / base["train"] < 1.34
    assert run("--reference-logprob")["logprob"] > 2 * run()["logprob"]
    assert run("--decode-eff", "0.25")["gen"] > 1.5 * run()["gen"]
    assert run("--no-offload")["prepare"] < run()["prepare"]


def test_fp8_row_checks_the_unfitted_fp8_gain():
    """NeMo-RL's H100 FP8 Llama-3.1-8B 1-step-off row (53.0 s): FP8 engines and FP8 training at the public 1.3x
    gain, no parameter fitted on it, within 5 %."""
    (c,) = compare(precision="fp8")
    assert c.name == "llama3.1-8b 1-off fp8" and c.ratio == pytest.approx(0.984, abs=0.01)
