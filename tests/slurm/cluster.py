"""The live one-node SLURM cluster of `slurm/local-cluster.sh` (CI's SLURM tier starts it): submitting, waiting and
reading back what SLURM recorded. No accounting database runs there, so a finished job's state comes from
`scontrol show job` (kept MinJobAge = 10 minutes) and the job-completion log, not from sacct."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBCOMP = Path(os.environ.get("SLURM_LOCAL_STATE", "/tmp/megatron-spec-slurm")) / "log" / "jobcomp.log"

TINY = ["run.eval_every=0", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_tokens=24", "run.threads=1",
        "run.save_every=1", "run.report=false"]
"""The tiny recipe at its smallest: 2 prompts x 4 rollouts of up to 24 tokens, a checkpoint every step, no eval
and no HTML report (a step takes well under a second on an idle 2-core machine; the job's start dominates)."""


@pytest.fixture(scope="session")
def cluster() -> str:
    """The partition of the running local cluster; a clear failure (not a skip) when there is none, because these
    tests run only where the tier started one."""
    if shutil.which("sinfo") is None:
        pytest.fail("no SLURM client here: `bash slurm/local-cluster.sh start` installs and starts the local cluster")
    state = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True)
    if state.returncode != 0 or not re.search(r"\b(idle|mixed|allocated)\b", state.stdout):
        pytest.fail(f"the local SLURM cluster is not up ({state.stdout.strip() or state.stderr.strip()}): "
                    "bash slurm/local-cluster.sh start")
    return state.stdout.split()[0].rstrip("*")


def sbatch(script: Path, env: dict[str, str] | None = None) -> str:
    """Submit `script` from the checkout (the job's submit directory); returns the job id."""
    done = subprocess.run(["sbatch", "--parsable", str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=True)
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, WorkDir, StdOut, ...)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}


def _listed(job_id: str) -> bool:
    """Whether `squeue` still lists the job; a failed `squeue` (slurmctld busy on a loaded host) counts as listed,
    since an empty answer from a failed call would end the wait while the job still runs."""
    done = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return done.returncode != 0 or bool(done.stdout.strip())


def wait_for(job_id: str, timeout_s: float) -> dict[str, str]:
    """Wait until the job has left the queue and `scontrol` records a final state; returns that record."""
    deadline = time.time() + timeout_s
    while _listed(job_id) or job_state(job_id).get("JobState") not in FINAL_STATES:
        if time.time() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"job {job_id} still queued or running after {timeout_s:.0f} s: {job_state(job_id)}")
        time.sleep(1)
    return job_state(job_id)


def jobcomp(job_id: str) -> dict[str, str]:
    """The job's line in the job-completion log (written by slurmctld when the job ends)."""
    for _ in range(20):  # the line is written just after the job leaves the queue
        for line in JOBCOMP.read_text().splitlines() if JOBCOMP.is_file() else []:
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == job_id:
                return fields
        time.sleep(0.5)
    pytest.fail(f"job {job_id} is not in the job-completion log {JOBCOMP}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def recipe_dryrun_script(*argv: str) -> str:
    """The sbatch script `python recipes/tiny_grpo_spec.py ... --dryrun` prints (the section after its header)."""
    out = subprocess.run([sys.executable, "recipes/tiny_grpo_spec.py", *argv, "--dryrun"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.split("# sbatch script", 1)[1].split("\n", 1)[1]
