"""Executor plans: validated plain dicts describing where a job runs. No dependencies, so `--dryrun` can print
them anywhere; `executors.build_executor(plan)` turns one into the matching NeMo-Run executor."""

from __future__ import annotations

import re

_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")

RAY_TEMPLATE = "slurm/ray.sub"
"""The sbatch template that starts Ray on an allocation and runs the driver on its head (see slurm/README.md)."""


def local_plan(ntasks_per_node: int = 1, env_vars: dict[str, str] | None = None) -> dict:
    """This machine, one process (what `--executor local` does in-process)."""
    _positive("ntasks_per_node", ntasks_per_node)
    return {"executor": "local", "nodes": 1, "ntasks_per_node": ntasks_per_node, "env_vars": dict(env_vars or {})}


def slurm_plan(
    account: str,
    partition: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 1,
    time: str = "04:00:00",
    container_image: str | None = None,
    container_mounts: list[str] | tuple[str, ...] = (),
    ntasks_per_node: int | None = None,
    env_vars: dict[str, str] | None = None,
    ssh_host: str | None = None,
    ssh_user: str | None = None,
    job_dir: str | None = None,
) -> dict:
    """A SLURM batch job, in a pyxis container where `container_image` is given (on the nodes themselves where not).

    `gpus_per_node` defaults to one (a single-process job asks for one GPU, not a node's eight); `ntasks_per_node`
    to one task per GPU (the torchrun / Megatron convention), or 1 without GPUs.
    With `ssh_host` NeMo-Run submits over SSH from this machine; without it, it calls sbatch here (a login node).
    """
    if not account:
        raise ValueError("a SLURM job needs an account (--account)")
    _positive("nodes", nodes)
    if gpus_per_node < 0:
        raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
    if not _TIME.match(time):
        raise ValueError(f"time must be [D-]HH:MM:SS, got {time!r}")
    if ntasks_per_node is None:
        ntasks_per_node = max(gpus_per_node, 1)
    _positive("ntasks_per_node", ntasks_per_node)
    if ssh_host and not ssh_user:
        raise ValueError("an SSH tunnel needs a user (--ssh-user) along with the host")
    for mount in container_mounts:
        if ":" not in mount:
            raise ValueError(f"container mount {mount!r} is not SRC:DST")
    if ssh_host:
        tunnel = {"kind": "ssh", "host": ssh_host, "user": ssh_user, "job_dir": job_dir or f"/home/{ssh_user}/nemo_run"}
    else:
        tunnel = {"kind": "local", "job_dir": job_dir or ""}
    return {
        "executor": "slurm",
        "account": account,
        "partition": partition,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "ntasks_per_node": ntasks_per_node,
        "time": time,
        "container_image": container_image,
        "container_mounts": list(container_mounts),
        "env_vars": dict(env_vars or {}),
        "tunnel": tunnel,
    }


def ray_slurm_plan(account: str, partition: str | None = None, nodes: int = 1, gpus_per_node: int = 8,
                   **slurm_kwargs) -> dict:
    """A Ray cluster on a SLURM allocation: one Ray process per node owning all its GPUs, the head on the first
    node, the driver command on the head. Other arguments as `slurm_plan`."""
    if slurm_kwargs.get("ntasks_per_node", 1) != 1:
        raise ValueError("a Ray cluster runs one Ray process per node: ntasks_per_node must be 1")
    slurm_kwargs["ntasks_per_node"] = 1
    plan = slurm_plan(account, partition, nodes, gpus_per_node, **slurm_kwargs)
    plan["executor"] = "ray-slurm"
    plan["ray"] = {"head": "first node of the allocation", "workers": nodes - 1, "gpus": nodes * gpus_per_node,
                   "template": RAY_TEMPLATE}
    return plan


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
