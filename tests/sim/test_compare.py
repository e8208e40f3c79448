"""`report --compare-sim`: a run's measured stage times beside the simulator's prediction for its own config.

A synthetic run directory (the 8B recipe's config on the Megatron + vLLM backend, three steps of metrics whose
stage times are the simulator's own prediction with `gen` doubled) must read back as ratio 1.00 on every stage but
gen, 0.50 on gen: the table is the prediction for the run's config, not for some default. An embedded CPU run is
refused with the pointer to the CPU harness, and a malformed target before anything is read."""

import json

import pytest
import yaml

from megatron_spec.sim.compare import compare_run, config_for_run, measured
from megatron_spec.sim.pipeline import simulate


def write_run(tmp_path, trainer="megatron", generator="vllm"):
    cfg = yaml.safe_load(open("configs/qwen3_8b_grpo_spec.yaml"))
    cfg["backend"].update(trainer=trainer, generator=generator, placement="colocated", generators=8, async_lag=0)
    cfg["backend"]["megatron"].update(tp=2, pp=1, ep=1, cp=1)
    cfg["model"]["policy"] = "Qwen/Qwen3-8B"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    figures = {"mean": 1500.0, "longest": 6000.0, "tau": 2.6}
    stages = simulate(config_for_run(cfg, figures, "h100", 32, 200)).stages
    rows = [{"step": i, "stages": dict(stages, gen=2 * stages["gen"]), "response_len_mean": 1500.0,
             "response_len_max": 6000.0, "acceptance_length": 2.6} for i in range(3)]
    rows[0]["stages"] = {s: 10 * t for s, t in rows[0]["stages"].items()}  # warm-up step: left out of the means
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return stages


def test_prediction_is_for_the_runs_config(tmp_path):
    stages = write_run(tmp_path)
    _, got, figures = measured(tmp_path)
    assert got["gen"] == pytest.approx(2 * stages["gen"]) and figures["tau"] == 2.6
    table = compare_run(tmp_path, "h100:32").splitlines()
    ratios = {line.split()[0]: line.split()[-1] for line in table[1:]}
    assert ratios["gen"] == "0.50"
    assert all(ratios[s] == "1.00" for s in ("data", "prepare", "train")), table
    assert ratios["logprob"] == "-"  # the recipe folds the recompute into train: 0 measured, 0 predicted


def test_refusals(tmp_path):
    write_run(tmp_path, trainer="embedded", generator="embedded")
    with pytest.raises(ValueError, match="research.sim_cpu"):
        compare_run(tmp_path, "h100:32")
    with pytest.raises(ValueError, match="HARDWARE:GPUS"):
        compare_run(tmp_path, "h100")


def test_a_relogged_step_counts_once(tmp_path):
    """metrics.jsonl is appended to: a resumed run re-logs the steps after its checkpoint, and a fresh run in a used
    directory logs after the old run's lines. The old run's three steps (every stage 100x, responses of 1 token)
    written before this run's must not count: the last record of each step wins."""
    stages = write_run(tmp_path)
    old = [{"step": i, "stages": {s: 100 * t for s, t in stages.items()}, "response_len_mean": 1.0,
            "response_len_max": 1.0} for i in range(3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old) + path.read_text())
    _, got, figures = measured(tmp_path)
    assert got["gen"] == pytest.approx(2 * stages["gen"]) and figures["mean"] == 1500.0


def test_memory_beside_the_simulated(tmp_path):
    """The memory the run logged (largest per-step peak of each trainer rank and of the loop and generator
    processes) sits beside the simulator's memory per GPU for the run's layout: the trainer's total and its parts
    for the run's params_dtype, the engine's weights and workspace. A bfloat16 run shows `memory_report` as it is;
    the same run with float32 parameters shows weights + gradients x 8/6 and the optimizer x 8/12."""
    write_run(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    memory = [{"trainer_peak_rss_mb": [900.0, 800.0], "loop_peak_rss_mb": 1000.0, "children_peak_rss_mb": [450.0]},
              {"trainer_peak_rss_mb": [950.0, 700.0], "loop_peak_rss_mb": 990.0, "children_peak_rss_mb": [440.0]},
              {"trainer_peak_rss_mb": [920.0, 810.0], "loop_peak_rss_mb": 995.0}]
    rows = [dict(json.loads(line), memory=m) for line, m in zip(lines, memory)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    _, _, figures = measured(tmp_path)
    mem = simulate(config_for_run(cfg, figures, "h100", 32, 200)).memory
    MB = 2 ** 20
    out = compare_run(tmp_path, "h100:32")
    assert "RSS 950 / 810" in out and "loop RSS 1000" in out and "generator processes RSS 450" in out
    assert f"simulated: {mem.train_total / MB:.0f} = weights+grads {mem.train_weights / MB:.0f}" in out
    assert f"engine weights {mem.engine_weights / MB:.0f}" in out
    cfg["backend"]["megatron"]["params_dtype"] = "float32"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = compare_run(tmp_path, "h100:32")
    weights, optimizer = mem.train_weights * 8 / 6 / MB, mem.train_optimizer * 8 / 12 / MB
    assert f"weights+grads {weights:.0f} + optimizer {optimizer:.0f}" in out


def test_drafter_training_settings_reach_the_prediction(tmp_path):
    """The run's online drafter settings set the drafter's training in the prediction: the embedded trainer's
    drafts x replay x updates passes and replay x updates x minibatches optimizer steps; the Megatron trainer's
    drafts in one update a step."""
    write_run(tmp_path)
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    cfg["drafter_train"].update(online=True, drafts=3, replay=4, minibatches=8, updates=1)
    figures = {"mean": 1500.0, "longest": 6000.0, "tau": 2.6}
    spec = config_for_run(cfg, figures, "h100", 32, 200).spec
    assert (spec.online_drafter_training, spec.drafter_passes, spec.drafter_optimizer_steps) == (True, 3, 1)
    cfg["backend"]["trainer"] = "embedded"
    spec = config_for_run(cfg, figures, "h100", 32, 200).spec
    assert (spec.drafter_passes, spec.drafter_optimizer_steps) == (12, 32)
