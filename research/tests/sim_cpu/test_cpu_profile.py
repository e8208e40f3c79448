"""Validation of the CPU profile: predicted vs measured step time of a plain decode loop over a matmul stack with
tiny-qwen3 and SmolLM2-135M shapes, at batch 1 and 8, within 15 %.

The profile is measured once per thread count (about a second) right before the loops, so both see the same
machine state; the prediction is the simulator's roofline with that profile and no per-case constant (the loop's
operator count, 13 per layer, is a fact of the loop). With one torch thread both are timed on the thread's CPU
clock, immune to the preemptions of a shared machine. Two-thread timings are only meaningful when two cores are
free: that case skips, saying why, when the machine is oversubscribed.

These are timing measurements, and even the CPU-clock case missed its 15 % bound in about 1 run of 4 on the CI
machine, so they run only when asked for (`MEGATRON_SPEC_TIMING_TESTS=1 pytest research/tests/sim_cpu/test_cpu_profile.py`),
keeping the default suite deterministic; otherwise they skip and print why.
"""

import json
import os
from pathlib import Path

import pytest

from research.sim_cpu.cpu_check import measured_step_seconds, predicted_step_seconds
from research.sim_cpu.cpu_profile import CpuProfile, load_or_measure, measure

CASES = {"tiny-qwen3": dict(steps=5, repeats=100), "smollm2-135m": dict(steps=1, repeats=12)}


def _oversubscribed(threads: int) -> str:
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if threads > 1 and load > cores - threads + 1:
        return f"load average {load:.1f} on {cores} cores leaves no {threads} free cores for a wall-clock timing"
    return ""


@pytest.fixture(scope="module", params=[1, 2])
def profile(request):
    if os.environ.get("MEGATRON_SPEC_TIMING_TESTS") != "1":
        reason = "wall-clock validation of the CPU profile is opt-in: set MEGATRON_SPEC_TIMING_TESTS=1"
        print(f"skipping {request.param}-thread CPU check: {reason}")
        pytest.skip(reason)
    reason = _oversubscribed(request.param)
    if reason:
        print(f"skipping {request.param}-thread CPU check: {reason}")
        pytest.skip(reason)
    return measure(request.param)


@pytest.mark.parametrize("model", list(CASES))
def test_decode_loop_within_15_percent(profile, model):
    """Fastest-of-N timings filter preemptions but not a neighbour's burst of memory traffic, which can slow a
    whole measurement by 10-20 %; one disturbed attempt is therefore retried once (profile and loop again)."""
    for attempt in range(2):
        prof = profile if attempt == 0 else measure(profile.threads)
        measured = measured_step_seconds(model, (1, 8), prof.threads, **CASES[model])
        errors = {}
        for batch, seconds in measured.items():
            predicted = predicted_step_seconds(model, batch, prof)
            errors[batch] = predicted / seconds - 1
            print(f"{model} batch {batch} threads {prof.threads}: measured {seconds * 1e3:.3f} ms, "
                  f"predicted {predicted * 1e3:.3f} ms ({100 * errors[batch]:+.1f} %)")
        if all(abs(e) <= 0.15 for e in errors.values()):
            return
    raise AssertionError(f"{model}: prediction off by more than 15 % twice: {errors}")


def test_profile_is_cached_and_reloaded(tmp_path):
    """load_or_measure returns a cached profile unchanged (no timing: the committed profile stands in for a
    measurement); a profile written before the eager figures existed is refused with a clear message."""
    committed = CpuProfile.load(Path(__file__).resolve().parents[3] / "research/records/sim_cpu_profile.json")
    path = committed.save(tmp_path / "cpu.json")
    again = load_or_measure(path, threads=committed.threads)
    assert again == committed == CpuProfile.load(path)
    hw = again.to_hardware()
    assert hw.roof(1.0, 2.0) == 3.0 and hw.op_overhead_s == committed.op_overhead_s  # no overlap on the CPU
    assert hw.seq_overhead_s == committed.seq_overhead_s and hw.act_bw == committed.act_bw
    stale = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("seq_overhead_s", "act_bw")}
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="lacks seq_overhead_s, act_bw"):
        CpuProfile.load(tmp_path / "stale.json")
    bare = committed.without_overheads().to_hardware()
    assert bare.op_overhead_s == bare.seq_overhead_s == bare.seq_layer_s == 0
