"""Submit one command under a plan's executor, through NeMo-Run."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from .executors import build_executor, nemo_run
from .render import log_dir, render_sbatch


def submit(plan: dict, name: str, command: list[str], workdir: str | Path, detach: bool = True):
    """Run `command` (an argv, executed from the checkout on the cluster) where `plan` says.

    `slurm`: one `run.Script` task in a `run.Experiment` on NeMo-Run's SlurmExecutor (NeMo-Run packages the git
    checkout's HEAD into its job directory and runs the command there). Returns the experiment.
    `ray-slurm`: `slurm/ray.sub` rendered for the plan (Ray on the allocation, the command on its head), submitted
    with sbatch from `workdir` through NeMo-Run's tunnel. Returns the SLURM job id.
    """
    if plan["executor"] == "local":
        raise ValueError("a local plan runs in-process; submit is for slurm and ray-slurm")
    line = shlex.join(command)
    if plan["executor"] == "ray-slurm":
        return submit_sbatch(plan, name, line, workdir)
    run = nemo_run()
    executor = build_executor(plan)
    # A Script rather than a Partial: the remote side runs the very command a user can run (and --dryrun) by hand,
    # instead of a fiddle-serialised call that would need every config class importable by NeMo-Run's runner.
    with run.Experiment(name, executor=executor, base_dir=plan["tunnel"]["job_dir"] or None) as exp:
        # `exec`: the recipe replaces the script's shell, so SLURM's signal to the step finds the RL loop, not a
        # shell that a signal would end.
        exp.add(run.Script(inline=f"exec {line}"), executor=executor, name=name)
        exp.run(detach=detach)
    return exp


def submit_sbatch(plan: dict, name: str, command: str, workdir: str | Path) -> str:
    """Render the plan's template into `<workdir>/<log dir>/<name>-<time>.sub` and `sbatch` it from `workdir` with
    NeMo-Run's local tunnel; the job's output goes to `<log dir>/<name>-<job id>.out`. Returns the job id."""
    if plan["tunnel"]["kind"] != "local":
        raise ValueError(f"{plan['executor']} submits from the checkout on the cluster: run it on a login node there")
    run = nemo_run()
    logs = Path(workdir) / log_dir(plan)
    logs.mkdir(parents=True, exist_ok=True)  # sbatch does not create the output's directory
    script = logs / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.sub"
    script.write_text(render_sbatch(plan, command, name))
    tunnel = run.LocalTunnel(job_dir=str(logs))
    done = tunnel.run(f"cd {shlex.quote(os.fspath(workdir))} && sbatch --parsable {shlex.quote(str(script))}")
    job_id = done.stdout.strip().split(";")[0]
    print(f"{name}: submitted SLURM job {job_id} ({script}); output in {logs}/{name}-{job_id}.out")
    return job_id
