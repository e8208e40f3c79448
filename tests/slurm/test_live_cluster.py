"""Every sbatch template we ship, submitted to the live local SLURM cluster with the tiny recipe: the plain one-job
template as the recipe renders it, the Ray template (head on the node, the command on the head; the Ray driver
through `--executor ray-slurm` is test_ray_slurm_signal.py's), NeMo-Run's SlurmExecutor through the recipe, a failing job, and scancel then resubmission resuming from the last checkpoint.

Each test asserts what SLURM recorded (JobState and ExitCode from `scontrol`, the job-completion log, the job gone
from `squeue`), where the output and the run directory landed, and what the run left there (metrics per step, the
checkpoint `latest` points to). Nothing is timed: the machine may be shared."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers import ray_slurm_plan, render_sbatch

from .cluster import ROOT, TINY, free_port, jobcomp, recipe_dryrun_script, sbatch, wait_for

pytestmark = pytest.mark.slurm


def tiny_command(out_dir: Path, steps: int, *extra: str) -> str:
    return " ".join(["python recipes/tiny_grpo_spec.py", f"run.steps={steps}", f"run.out_dir={out_dir}", *TINY,
                     *extra, "--executor local"])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def checkpoint_digest(run_dir: Path) -> dict[str, str]:
    """Every file under checkpoints/, by content: a failed job must leave them byte for byte as they were."""
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def assert_finished(job_id: str, state: dict, exit_code: str, job_state: str) -> None:
    assert (state["JobState"], state["ExitCode"]) == (job_state, exit_code), state
    assert jobcomp(job_id)["JobState"] == job_state
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip() == ""


@pytest.fixture(scope="module")
def plain_run(cluster, tmp_path_factory):
    """The tiny recipe (3 steps) through the plain template exactly as `--executor slurm --dryrun` renders it."""
    tmp = tmp_path_factory.mktemp("plain")
    run_dir = tmp / "run"
    script = recipe_dryrun_script("--executor", "slurm", "--account", "A", "--partition", cluster,
                                  "--gpus-per-node", "0", "--job-dir", str(tmp), "run.steps=3", f"run.out_dir={run_dir}",
                                  *TINY)
    (tmp / "job.sub").write_text(script)
    job_id = sbatch(tmp / "job.sub")
    return tmp, run_dir, job_id, wait_for(job_id, timeout_s=300)


def test_plain_template_runs_the_tiny_recipe(plain_run):
    """Completed with exit 0; the output is where the rendered `--output` says (the job dir, named after the job)
    and ends with the recipe's summary of step 2; the run directory holds 3 steps of metrics and `latest` is the
    step-2 checkpoint."""
    tmp, run_dir, job_id, state = plain_run
    assert_finished(job_id, state, "0:0", "COMPLETED")
    out = tmp / f"tiny_grpo_spec-{job_id}.out"
    assert state["StdOut"] == str(out)
    text = out.read_text()
    assert "job.sub: COMMAND exited with 0" in text
    summary = json.loads(text.strip().splitlines()[-2])  # the recipe's JSON line, then the template's last echo
    assert summary["step"] == 2
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2] and latest(run_dir) == "step_000002"


def test_bad_config_fails_with_the_error_in_its_log_and_keeps_the_checkpoints(plain_run):
    """A resubmission of the same run directory with a different learning rate: the recipe refuses to resume
    (one-line error, exit 2) before touching anything, SLURM records FAILED 2:0, and the checkpoints are byte for
    byte those of the finished run."""
    tmp, run_dir, _, _ = plain_run
    before = checkpoint_digest(run_dir)
    script = tmp / "bad.sub"
    script.write_text(recipe_dryrun_script("--executor", "slurm", "--account", "A", "--gpus-per-node", "0",
                                           "--job-dir", str(tmp), "run.steps=5", f"run.out_dir={run_dir}", *TINY,
                                           "grpo.lr=0.5"))
    job_id = sbatch(script)
    state = wait_for(job_id, timeout_s=180)
    assert_finished(job_id, state, "2:0", "FAILED")
    log = (tmp / f"tiny_grpo_spec-{job_id}.out").read_text()
    assert "tiny_grpo_spec: error: resume directory" in log and "grpo.lr" in log
    assert "job.sub: COMMAND exited with 2" in log
    assert checkpoint_digest(run_dir) == before and latest(run_dir) == "step_000002"


def test_scancel_then_resubmit_resumes_from_the_last_checkpoint(cluster, tmp_path):
    """A 60-step run is cancelled once it has saved at least 2 checkpoints; SLURM records CANCELLED; the
    checkpoint `latest` names is complete (it loads); the resubmitted job prints that it resumed from exactly that
    step and finishes the steps after it, so metrics.jsonl holds each of those steps once more."""
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sub"
    script.write_text(recipe_dryrun_script("--executor", "slurm", "--account", "A", "--gpus-per-node", "0",
                                           "--job-dir", str(tmp_path), "run.steps=60", f"run.out_dir={run_dir}",
                                           *TINY))
    job_id = sbatch(script)
    deadline = time.time() + 240
    while not ((run_dir / "checkpoints" / "latest").is_file() and int(latest(run_dir)[5:]) >= 1):
        assert time.time() < deadline, "no second checkpoint within 240 s"
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=True)
    state = wait_for(job_id, timeout_s=60)
    assert_finished(job_id, state, state["ExitCode"], "CANCELLED")
    saved = int(latest(run_dir)[5:])
    assert saved < 59
    import torch

    assert torch.load(run_dir / "checkpoints" / latest(run_dir) / "state.pt", weights_only=False)["step"] == saved

    steps = saved + 3
    script.write_text(recipe_dryrun_script("--executor", "slurm", "--account", "A", "--gpus-per-node", "0",
                                           "--job-dir", str(tmp_path), f"run.steps={steps}", f"run.out_dir={run_dir}",
                                           *TINY))
    job_id = sbatch(script)
    state = wait_for(job_id, timeout_s=300)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    log = (tmp_path / f"tiny_grpo_spec-{job_id}.out").read_text()
    assert f"resumed from {run_dir}/checkpoints (step {saved})" in log
    assert latest(run_dir) == f"step_{steps - 1:06d}"
    logged = [m["step"] for m in metrics(run_dir)]
    assert logged[-(steps - saved - 1):] == list(range(saved + 1, steps))


def test_ray_template_runs_the_tiny_recipe_on_the_head(cluster, tmp_path):
    """`slurm/ray.sub` rendered for a one-node CPU allocation: the head starts, the wait-for-GPUs step passes (0
    GPUs asked), COMMAND runs on the head inside the Ray cluster's environment (RAY_ADDRESS is the head's address,
    checked by the command itself) and its exit code is the job's; the run completes; no Ray process of this job
    is left on the node afterwards (its GCS port is closed)."""
    run_dir, logs = tmp_path / "run", tmp_path / "ray-logs"
    port = free_port()
    plan = ray_slurm_plan("A", cluster, nodes=1, gpus_per_node=0, time="00:20:00", job_dir=str(tmp_path),
                          env_vars={"RAY_PORT": str(port), "RAY_DASHBOARD_PORT": str(free_port()),
                                    "LOG_DIR": str(logs), "RAY_WAIT_S": "120"})
    check = f'[[ $RAY_ADDRESS == *:{port} ]] || exit 9'
    script = tmp_path / "ray.sub"
    script.write_text(render_sbatch(plan, f"{check} && {tiny_command(run_dir, 2)}", "tiny_ray"))
    job_id = sbatch(script)
    state = wait_for(job_id, timeout_s=400)
    out = (tmp_path / f"tiny_ray-{job_id}.out").read_text()
    assert_finished(job_id, state, "0:0", "COMPLETED")
    assert "ray.sub: Ray cluster up with 0 GPUs" in out and "ray.sub: COMMAND exited with 0" in out
    assert "Ray runtime started" in (logs / "ray-head.log").read_text()
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and latest(run_dir) == "step_000001"
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the job's Ray head still listens after the job ended"


def test_nemo_run_slurm_executor_submits_the_recipe(cluster, tmp_path):
    """`nemo-run recipes/tiny_grpo_spec.py --executor slurm --account A` with the installed nemo_run: its
    SlurmExecutor (local tunnel) packages the checkout's HEAD into the job directory and submits its own sbatch
    script, whose srun passes pyxis's container flags (given their meaning here by the cluster's nocontainer
    plugin); the job completes and the run lands in the run directory asked for."""
    pytest.importorskip("nemo_run")
    run_dir = tmp_path / "run"
    nemo_run = Path(sys.executable).with_name("nemo-run")
    argv = [str(nemo_run) if nemo_run.exists() else "nemo-run", "recipes/tiny_grpo_spec.py", "--executor", "slurm",
            "--account", "A", "--partition", cluster, "--gpus-per-node", "0", "--job-dir", str(tmp_path),
            "run.steps=2", f"run.out_dir={run_dir}", *TINY]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NEMORUN_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-2000:]
    task_dir = tmp_path / "experiments" / "tiny_grpo_spec"
    sbatch_out = sorted(task_dir.glob("*/tiny_grpo_spec/sbatch_*.out"))
    deadline = time.time() + 300  # the job's own wait below: a loaded host can take more than seconds to start it
    while not sbatch_out and time.time() < deadline:  # the file appears once the job starts
        time.sleep(1)
        sbatch_out = sorted(task_dir.glob("*/tiny_grpo_spec/sbatch_*.out"))
    assert len(sbatch_out) == 1, list(task_dir.rglob("*"))
    job_id = sbatch_out[0].stem.rsplit("_", 1)[1]
    state = wait_for(job_id, timeout_s=300)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    assert "job exited with code 0" in sbatch_out[0].read_text()
    assert (sbatch_out[0].parent / "code" / "recipes" / "tiny_grpo_spec.py").is_file()  # the packaged checkout
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and latest(run_dir) == "step_000001"


def test_signal_before_the_limit_saves_and_a_resubmission_resumes(cluster, tmp_path):
    """The plain template as the recipe renders it, `--time 00:03:00` and `run.signal_before_s=60`, far more steps
    than fit: SLURM sends USR1 to the batch shell 60 s before the limit, the template passes it on to the loop,
    which saves after the step in flight and exits 0 (COMPLETED 0:0, not TIMEOUT); `latest` names that step. The
    resubmission (same command, fewer steps left) prints that it resumed there and finishes, and metrics.jsonl
    then holds every step exactly once."""
    run_dir = tmp_path / "run"
    argv = ["--executor", "slurm", "--account", "A", "--partition", cluster, "--gpus-per-node", "0",
            "--job-dir", str(tmp_path), "--time", "00:03:00", f"run.out_dir={run_dir}", *TINY,
            "run.save_every=0", "run.signal_before_s=60"]
    script = tmp_path / "job.sub"
    script.write_text(recipe_dryrun_script(*argv, "run.steps=100000"))
    job_id = sbatch(script)
    state = wait_for(job_id, timeout_s=400)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    log = (tmp_path / f"tiny_grpo_spec-{job_id}.out").read_text()
    assert "job.sub: USR1 before the time limit passed on to the RL loop" in log
    saved = int(latest(run_dir)[5:])
    assert f"SIGUSR1: saved {run_dir}/checkpoints/step_{saved:06d} after step {saved}" in log
    assert [m["step"] for m in metrics(run_dir)] == list(range(saved + 1))

    steps = saved + 3
    script.write_text(recipe_dryrun_script(*argv, f"run.steps={steps}"))
    job_id = sbatch(script)
    state = wait_for(job_id, timeout_s=300)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    log = (tmp_path / f"tiny_grpo_spec-{job_id}.out").read_text()
    assert f"resumed from {run_dir}/checkpoints (step {saved})" in log
    assert [m["step"] for m in metrics(run_dir)] == list(range(steps))
    assert latest(run_dir) == f"step_{steps - 1:06d}"
