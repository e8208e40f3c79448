"""Validation (b): the embedded engine's measured stage times (`megatron-spec bench step` on this CPU).

The real measurement file does not exist until the engine and RL loop land; that test skips, saying so. The
plumbing (schema, prediction, comparison) is tested on synthetic files.
"""

import json
from pathlib import Path

import pytest

from megatron_spec.sim.measured import DEFAULT_MEASUREMENT, compare, config_from_measurement, format_comparison
from megatron_spec.sim.pipeline import simulate

REPO = Path(__file__).resolve().parents[2]
RAW = {
    "machine": "test", "model": "tiny-qwen3",
    "workload": {"prompts_per_step": 8, "group_size": 4, "prompt_len": 16,
                 "response": {"mean": 40, "max_tokens": 96, "sigma": 0.5}},
    "stages": {}, "spec": {"k": 3, "acceptance_length": 2.5, "drafter": "model", "draft_model": "tiny-draft"},
    "threads": 1,
}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    from megatron_spec.sim.cpu_profile import load_or_measure

    path = tmp_path_factory.mktemp("cpu") / "cpu_profile.json"
    load_or_measure(path, threads=1)
    return str(path)


def test_bench_step_measurement():
    path = REPO / DEFAULT_MEASUREMENT
    if not path.is_file():
        reason = f"{DEFAULT_MEASUREMENT} not present: `megatron-spec bench step` has not been run on this machine yet"
        print(f"skipping validation (b): {reason}")
        pytest.skip(reason)
    rows = compare(path)
    print(format_comparison(rows))
    assert all(r.ok for r in rows), format_comparison(rows)


def test_comparison_plumbing(tmp_path, profile_path):
    """A file whose stages are the model's own prediction compares as exact; one with gen 30 % slower fails."""
    predicted = simulate(config_from_measurement(RAW, profile_path)).stages
    good = dict(RAW, stages=predicted)
    (tmp_path / "good.json").write_text(json.dumps(good))
    rows = compare(tmp_path / "good.json", profile_path)
    assert all(r.ok and abs(r.rel_error) < 1e-9 for r in rows)
    bad = dict(RAW, stages=dict(predicted, gen=predicted["gen"] * 1.3))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    rows = {r.stage: r for r in compare(tmp_path / "bad.json", profile_path)}
    assert not rows["gen"].ok or predicted["gen"] < 0.05


def test_schema_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks 'stages'"):
        config_from_measurement({"model": "tiny-qwen3", "workload": RAW["workload"]})
    with pytest.raises(FileNotFoundError, match="bench step"):
        compare(tmp_path / "missing.json")
