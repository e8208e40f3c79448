"""NeMo-Run executors built from the plans of `plans.py` (`nemo_run` is imported here, lazily)."""

from __future__ import annotations

import os

from .extras import require_extras
from .plans import local_plan, ray_slurm_plan, slurm_plan


def nemo_run():
    """The `nemo_run` module, or a MissingExtra naming the `nemo` extra."""
    require_extras(("nemo",), "launching through NeMo-Run")
    import nemo_run as run

    return run


def build_executor(plan: dict):
    """The NeMo-Run executor a plan describes (LocalExecutor, or SlurmExecutor for `slurm` and `ray-slurm`)."""
    run = nemo_run()
    if plan["executor"] == "local":
        return run.LocalExecutor(ntasks_per_node=plan["ntasks_per_node"], env_vars=dict(plan["env_vars"]))
    if plan["executor"] not in ("slurm", "ray-slurm"):
        raise ValueError(f"unknown executor {plan['executor']!r}: use local, slurm or ray-slurm")
    tunnel = plan["tunnel"]
    if tunnel["kind"] == "ssh":
        tunnel = run.SSHTunnel(host=tunnel["host"], user=tunnel["user"], job_dir=tunnel["job_dir"])
    else:  # NeMo-Run writes a local experiment under <job_dir>/experiments, where Experiment(base_dir=job_dir) puts it
        tunnel = run.LocalTunnel(job_dir=os.path.join(tunnel["job_dir"], "experiments") if tunnel["job_dir"] else "")
    return run.SlurmExecutor(
        account=plan["account"],
        partition=plan["partition"],
        nodes=plan["nodes"],
        ntasks_per_node=plan["ntasks_per_node"],
        gpus_per_node=plan["gpus_per_node"] or None,  # None: no --gpus-per-node line at all on CPU partitions
        time=plan["time"],
        container_image=plan["container_image"],
        container_mounts=list(plan["container_mounts"]),
        env_vars=dict(plan["env_vars"]),
        tunnel=tunnel,
        # A Ray node process owns every GPU of its node; SLURM must not hand the node to another job.
        exclusive=True if plan["executor"] == "ray-slurm" else None,
        # and the CPUs the plan gives it (None: SLURM's default for the step)
        cpus_per_task=(plan.get("ray") or {}).get("cpus_per_task"),
        # NeMo-Run's script runs its step in the foreground, so no trap there could pass a batch-shell signal on:
        # SIGUSR1 goes to the step's processes instead (`submit` execs the recipe, so the loop is the step's task).
        signal=nemo_run_signal(plan),
    )


def nemo_run_signal(plan: dict) -> str | None:
    """NeMo-Run's `--signal`: the plan's signal before the time limit sent to the job step (not the batch shell)."""
    signal = (plan.get("save") or {}).get("signal")
    return signal.removeprefix("B:") if signal else None


def local_executor(ntasks_per_node: int = 1, env_vars: dict[str, str] | None = None):
    """`run.LocalExecutor`: a subprocess on this machine (for NeMo-Run experiments composed by hand)."""
    return build_executor(local_plan(ntasks_per_node, env_vars))


def slurm_executor(account: str, partition: str | None, nodes: int, gpus_per_node: int, time: str,
                   container_image: str | None, **kwargs):
    """`run.SlurmExecutor` for a batch job in a pyxis container; other arguments as `plans.slurm_plan`."""
    return build_executor(slurm_plan(account, partition, nodes, gpus_per_node, time, container_image, **kwargs))


def ray_slurm_executor(account: str, partition: str | None, nodes: int, gpus_per_node: int, time: str,
                       container_image: str | None, **kwargs):
    """`run.SlurmExecutor` shaped for a Ray cluster (one task per node, exclusive nodes), for NeMo-Run experiments
    composed by hand; `submit` runs a ray-slurm plan through `slurm/ray.sub` instead."""
    return build_executor(
        ray_slurm_plan(account, partition, nodes, gpus_per_node, time=time, container_image=container_image, **kwargs)
    )
