"""The tiny MoE recipe on the Megatron trainer (EP 2, two trainer ranks as Ray actors beside our engine) submitted
through `--executor ray-slurm`, exactly as a user submits it: `slurm/ray.sub` rendered, Ray started on the
allocation with the template's fixed ports and CPUs, the Ray driver on the head. A short `--time` and far more steps
than fit: SLURM's USR1 before the limit reaches the batch shell, which passes it on to the driver; the loop saves
the step in flight (every rank its shards) and exits 0. A second submission of the same command resumes there, and
metrics.jsonl then holds every step exactly once. Nothing is timed: the machine may be shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import ROOT, free_port, wait_for
from .test_live_cluster import assert_finished, latest, metrics

pytestmark = pytest.mark.slurm

MOE = ["backend.trainer=megatron", "backend.megatron.ep=2", "backend.placement=colocated", "run.eval_every=0",
       "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_tokens=24", "run.threads=1", "run.report=false",
       "run.save_every=0", "run.signal_before_s=60"]
"""Two Megatron ranks (EP 2) and one engine on the node's 2 CPUs, 2 prompts x 4 rollouts of up to 24 tokens (the
recipe's MTP drafter on), no step cadence: the only saves are the signal's and the end's. USR1 comes 60 s before the
3-minute limit: on an idle 2-core machine Ray and the ranks start within about a minute and a step then takes well
under a second, and a step plus the save fit the 60 s left."""


def submit(cluster: str, tmp: Path, run_dir: Path, steps: int, n: int) -> tuple[str, dict, str]:
    """Submit the recipe through ray-slurm; returns (job id, its final state, its output) once it left the queue."""
    port = free_port()
    argv = [sys.executable, "recipes/tiny_moe_grpo_spec.py", *MOE, f"run.out_dir={run_dir}", f"run.steps={steps}",
            "--executor", "ray-slurm", "--account", "A", "--partition", cluster, "--gpus-per-node", "0",
            "--job-dir", str(tmp), "--time", "00:03:00"]
    env = {**os.environ, "RAY_PORT": str(port), "RAY_DASHBOARD_PORT": "0", "RAY_WAIT_S": "120",
           "LOG_DIR": str(tmp / f"ray-logs-{n}")}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    job_id = done.stdout.split("submitted SLURM job ", 1)[1].split()[0]
    state = wait_for(job_id, timeout_s=400)
    out = (tmp / f"tiny_moe_grpo_spec-{job_id}.out").read_text()
    assert "Connecting to existing Ray cluster at address: " in out and f":{port}" in out  # the job's own Ray
    return job_id, state, out


def test_megatron_moe_through_ray_slurm_saves_on_the_signal_and_resumes(cluster, tmp_path):
    """First job: COMPLETED 0:0 (not TIMEOUT) after ray.sub passed USR1 on; the driver joined the job's own Ray
    cluster (its port) and ran the steps; `latest` is the step the loop says it saved, a Megatron distributed
    checkpoint with shard files of both trainer ranks, and metrics.jsonl holds steps 0..saved. Second job (3 steps more): resumed from that step, COMPLETED, metrics.jsonl holds every step once."""
    for module in ("nemo_run", "ray", "megatron.core"):
        pytest.importorskip(module)
    run_dir = tmp_path / "run"
    job_id, state, out = submit(cluster, tmp_path, run_dir, 100000, 1)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    assert "ray.sub: USR1 before the time limit passed on to the RL loop" in out
    saved = int(latest(run_dir)[5:])
    assert f"SIGUSR1: saved {run_dir}/checkpoints/step_{saved:06d} after step {saved}" in out
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == list(range(saved + 1))
    assert all(m["generator_restarts"] == 0 for m in logged)  # logged by the Ray driver, which ran the steps
    shards = [p.name for p in (run_dir / "checkpoints" / latest(run_dir) / "policy").iterdir()]
    assert {s.split("_")[2] for s in shards if s.endswith(".distcp")} == {"0", "1"}, shards

    steps = saved + 3
    job_id, state, out = submit(cluster, tmp_path, run_dir, steps, 2)
    assert_finished(job_id, state, "0:0", "COMPLETED")
    assert f"resumed from {run_dir}/checkpoints (step {saved})" in out
    assert [m["step"] for m in metrics(run_dir)] == list(range(steps))
    assert latest(run_dir) == f"step_{steps - 1:06d}"
