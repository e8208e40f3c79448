"""Submit one command under a plan's executor through NeMo-Run."""

from __future__ import annotations

import shlex
from pathlib import Path

from .executors import build_executor, nemo_run


def submit(plan: dict, name: str, command: list[str], workdir: str | Path, detach: bool = True):
    """Run `command` (an argv, executed from the packaged code directory) where `plan` says.

    `slurm`: one `run.Script` task in a `run.Experiment` on a SLURM allocation (NeMo-Run packages the git
    checkout). `ray-slurm`: a Ray cluster on the allocation with `command` as the driver on its head
    (NeMo-Run's `RayJob`; `workdir` is synced to the cluster). Returns the experiment or the Ray job.
    """
    if plan["executor"] == "local":
        raise ValueError("a local plan runs in-process; submit is for slurm and ray-slurm")
    run = nemo_run()
    executor = build_executor(plan)
    line = shlex.join(command)
    if plan["executor"] == "ray-slurm":
        from nemo_run.run.ray.job import RayJob

        job = RayJob(name=name, executor=executor)
        job.start(command=line, workdir=str(workdir))
        return job
    # A Script rather than a Partial: the remote side runs the very command a user can run (and --dryrun) by hand,
    # instead of a fiddle-serialised call that would need every config class importable by NeMo-Run's runner.
    with run.Experiment(name) as exp:
        exp.add(run.Script(inline=line), executor=executor, name=name)
        exp.run(detach=detach)
    return exp
