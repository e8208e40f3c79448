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


RAY_PORTS = {
    "RAY_PORT": 6379,                      # the head's GCS: what `ray start --address` and the driver join
    "RAY_DASHBOARD_PORT": 8265,            # 0: no dashboard
    "RAY_CLIENT_PORT": 10001,              # Ray client server (head)
    "RAY_NODE_MANAGER_PORT": 6700,         # every node's raylet
    "RAY_OBJECT_MANAGER_PORT": 6701,       # every node's object transfers
    "RAY_RUNTIME_ENV_AGENT_PORT": 6702,
    "RAY_DASHBOARD_AGENT_GRPC_PORT": 6703,
    "RAY_DASHBOARD_AGENT_LISTEN_PORT": 6704,
    "RAY_METRICS_EXPORT_PORT": 6705,
    "MEGATRON_SPEC_RENDEZVOUS_PORT": 6706,  # the trainer group's torch.distributed store, on trainer rank 0's node
    "MEGATRON_SPEC_WEIGHTS_PORT": 6707,     # the refit's weight-update group's store, on trainer rank 0's node
    "RAY_MIN_WORKER_PORT": 10002,          # Ray's worker processes listen inside [min, max]
    "RAY_MAX_WORKER_PORT": 10999,
}
"""The fixed ports `slurm/ray.sub` starts Ray on, by the template's input names (the same defaults as the template's
own): nothing ephemeral, so a cluster's firewall can open exactly these and a port taken on a node is reported by
name before Ray starts (the template checks each is free)."""

OPEN_FILES = {"target": 65536, "min": 8192}
"""Open-file limit each Ray step raises its soft limit to (`target`, or the node's hard limit where that is lower),
and the least it accepts (`min`): Ray's raylet, object store and vLLM workers hold thousands of sockets and files,
and a default soft limit of 1024 fails with "Too many open files" only once the cluster is busy."""


def ray_ports(overrides: dict[str, int] | None = None) -> dict[str, int]:
    """RAY_PORTS with `overrides`, checked: every port in 1024..65535, no two the same, none of the single ports
    inside the worker range (Ray would hand it to a worker), a worker range of at least 64 ports (a worker process
    each)."""
    unknown = set(overrides or {}) - set(RAY_PORTS)
    if unknown:
        raise ValueError(f"unknown Ray ports {sorted(unknown)}: the ports are {', '.join(RAY_PORTS)}")
    ports = {**RAY_PORTS, **(overrides or {})}
    for name, port in ports.items():
        if not isinstance(port, int) or not (1024 <= port <= 65535 or (name == "RAY_DASHBOARD_PORT" and port == 0)):
            raise ValueError(f"{name}={port!r}: a port is an integer in 1024..65535 (RAY_DASHBOARD_PORT=0: none)")
    low, high = ports["RAY_MIN_WORKER_PORT"], ports["RAY_MAX_WORKER_PORT"]
    if high - low + 1 < 64:
        raise ValueError(f"the Ray worker ports {low}..{high} leave room for fewer than 64 workers: widen the range")
    single = {k: v for k, v in ports.items() if k not in ("RAY_MIN_WORKER_PORT", "RAY_MAX_WORKER_PORT") and v}
    seen: dict[int, str] = {}
    for name, port in single.items():
        if port in seen:
            raise ValueError(f"{name} and {seen[port]} are both {port}: give each its own port")
        if low <= port <= high:
            raise ValueError(f"{name}={port} lies in the Ray worker range {low}..{high}: move one of them")
        seen[port] = name
    return ports


def ray_slurm_plan(account: str, partition: str | None = None, nodes: int = 1, gpus_per_node: int = 8,
                   cpus_per_task: int | None = None, node_iface: str | None = None,
                   ports: dict[str, int] | None = None, open_files: dict[str, int] | None = None,
                   **slurm_kwargs) -> dict:
    """A Ray cluster on a SLURM allocation: one Ray process per node owning all its GPUs, the head on the first
    node, the driver command on the head. `cpus_per_task`: CPUs each node's Ray step gets (srun --cpus-per-task
    and Ray's --num-cpus; None: all the node's CPUs, SLURM_CPUS_ON_NODE); `node_iface`: the network interface
    whose address each node announces (None: the one that routes to the head); `ports`: overrides of RAY_PORTS;
    `open_files`: of OPEN_FILES. Other arguments as `slurm_plan`."""
    if slurm_kwargs.get("ntasks_per_node", 1) != 1:
        raise ValueError("a Ray cluster runs one Ray process per node: ntasks_per_node must be 1")
    if cpus_per_task is not None:
        _positive("cpus_per_task", cpus_per_task)
    if node_iface is not None and not re.match(r"^[\w.:-]{1,15}$", node_iface):
        raise ValueError(f"node_iface {node_iface!r} is not a network interface name (e.g. ib0, eth0, enp1s0)")
    limits = {**OPEN_FILES, **(open_files or {})}
    if not 1024 <= limits["min"] <= limits["target"]:
        raise ValueError(f"open files: need 1024 <= min <= target, got {limits}")
    slurm_kwargs["ntasks_per_node"] = 1
    plan = slurm_plan(account, partition, nodes, gpus_per_node, **slurm_kwargs)
    plan["executor"] = "ray-slurm"
    plan["ray"] = {"head": "first node of the allocation", "workers": nodes - 1, "gpus": nodes * gpus_per_node,
                   "template": RAY_TEMPLATE, "cpus_per_task": cpus_per_task, "node_iface": node_iface,
                   "open_files": limits, "ports": ray_ports(ports)}
    return plan


def ranks_by_node(layout: dict, nodes: int) -> list[dict]:
    """Which device units each node holds, node by node in allocation order, for an at-scale layout (`Scale.layout`):
    units are numbered node-major (node k holds units k*n .. k*n+n-1 of n = gpus / nodes), the trainer's ranks
    take units in rank order (disaggregated: the first units, the engines the rest; colocated: all of them, the
    engines too), so Megatron's groups of consecutive ranks (TP, then EP x ETP) stay on one node whenever their
    size divides n. Returns [{"node": k, "units": [a, b], "trainer_ranks": [a, b] | None, "engines": [i, j] |
    None}] with inclusive bounds."""
    per = layout["gpus"] // nodes
    train = layout["gpus"] if layout["ray"]["placement"] == "colocated" else \
        layout["gpus"] - layout["vllm"]["engines"] * layout["vllm"]["tensor_parallel_size"]
    tp = layout["vllm"]["tensor_parallel_size"]
    gen_start = 0 if layout["ray"]["placement"] == "colocated" else train
    out = []
    for k in range(nodes):
        a, b = k * per, (k + 1) * per - 1
        ranks = [a, min(b, train - 1)] if a < train else None
        g0, g1 = max(a, gen_start), b
        engines = [(g0 - gen_start) // tp, (g1 - gen_start) // tp] if g1 >= g0 else None
        out.append({"node": k, "units": [a, b], "trainer_ranks": ranks, "engines": engines})
    return out


def node_group_problems(layout: dict, nodes: int) -> list[str]:
    """Megatron's tensor-parallel groups must lie inside a node (their all-reduces run every layer), and its expert
    groups (EP x ETP consecutive ranks) inside a node or over whole nodes, given the node-major order of
    `ranks_by_node`; the trainer's share must end on a node boundary when the engines have nodes of their own."""
    per = layout["gpus"] // nodes
    if nodes == 1 or not per:  # one node holds every group
        return []
    meg = layout["megatron"]
    problems = []
    if meg["tp"] > per or per % meg["tp"]:
        problems.append(f"Megatron TP {meg['tp']} groups would straddle nodes of {per} devices: use a TP that "
                        f"divides {per}")
    expert = meg["ep"] * (meg.get("etp") or 1)
    if (expert <= per and per % expert) or (expert > per and expert % per):
        problems.append(f"Megatron expert groups of EP {meg['ep']} x ETP {meg.get('etp') or 1} = {expert} ranks "
                        f"would straddle nodes of {per} devices: make EP x ETP divide {per} or a multiple of it")
    if layout["ray"]["placement"] == "disaggregated":
        train = layout["gpus"] - layout["vllm"]["engines"] * layout["vllm"]["tensor_parallel_size"]
        if train % per:
            problems.append(f"the trainer's {train} devices end inside a node of {per}: a node would hold trainer "
                            "ranks and engines; give the engines whole nodes")
    return problems


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
