"""Process groups that start the same way on CPUs and GPUs: the trainer's group (torchrun or Ray actors) and the
weight-update group (`weight_group.py`) both start here.

- Device-correct collectives: `collective_device(backend)` is where a collective's tensors must live (CPU for gloo,
  this process's GPU for NCCL, which refuses host tensors); every collective this package issues at start-up makes
  its tensors there.
- Per-node ranks: `LOCAL_RANK` is a rank's index among the ranks on its own node (`local_ranks`), never the global
  rank, and selects the GPU when a process sees several (`local_device`; under Ray each actor sees only its own).
- A rendezvous that names who is missing: every rank registers in a TCP store before the group forms; rank 0 waits
  up to the start-up timeout (`backend.init_timeout_s`, long enough to cover model loading, because the same group
  then carries the calls that wait while rank 0 loads) and fails with the ranks that never arrived, and so do the
  others when rank 0 gave up.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

JOIN_KEY = "megatron_spec/joined/{}"
VERDICT_KEY = "megatron_spec/verdict"


class JoinError(RuntimeError):
    """A process group did not form within its start-up timeout; the message names the missing ranks."""


def collective_backend() -> str:
    """`nccl` where this process has a GPU, else `gloo`."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_device(backend: str, local_rank: int = 0) -> torch.device:
    """Where the tensors of a `backend` collective must live: the host for gloo, this rank's GPU for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return local_device(local_rank)
    raise ValueError(f"unknown collective backend {backend!r} (gloo or nccl)")


def local_device(local_rank: int) -> torch.device:
    """This rank's GPU: the only one it sees (Ray sets CUDA_VISIBLE_DEVICES per actor), else GPU `local_rank`."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device("cuda", 0 if visible == 1 else local_rank)


def local_ranks(nodes: list[str]) -> list[int]:
    """Each rank's index among the ranks on its own node, given every rank's node id in rank order."""
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def straddling_groups(nodes: list[str], size: int) -> list[int]:
    """Indices of the groups of `size` consecutive ranks (Megatron's TP groups; its expert groups of EP x ETP) whose
    ranks sit on more than one node, given every rank's node in rank order. A group larger than a node's ranks
    must span nodes and is not counted."""
    per_node = max(nodes.count(n) for n in set(nodes)) if nodes else 0
    if size <= 1 or size > per_node:
        return []
    return [g for g in range(len(nodes) // size) if len(set(nodes[g * size:(g + 1) * size])) > 1]


def free_port() -> int:
    """A port free at the moment of asking. Released before it is used, so another process may take it in between:
    for a store this process hosts, `host_rendezvous` binds port 0 instead and has no such gap."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This node's address for the others to reach: MEGATRON_SPEC_NODE_IP where the launcher set it (slurm/ray.sub:
    the address of the cluster network's interface), else what the hostname resolves to."""
    return os.environ.get("MEGATRON_SPEC_NODE_IP") or socket.gethostbyname(socket.gethostname())


def rendezvous_port() -> int:
    """The port the trainer group's rank 0 hosts its rendezvous on: MEGATRON_SPEC_RENDEZVOUS_PORT where the launcher
    fixed one (so a cluster's firewall can open it), else 0 (`host_rendezvous`: the OS picks one as it binds)."""
    return int(os.environ.get("MEGATRON_SPEC_RENDEZVOUS_PORT") or 0)


def weights_port() -> int:
    """The port trainer rank 0 hosts the weight-update group's rendezvous on: MEGATRON_SPEC_WEIGHTS_PORT where the
    launcher fixed one, else 0 (`host_rendezvous`: the OS picks one as it binds)."""
    return int(os.environ.get("MEGATRON_SPEC_WEIGHTS_PORT") or 0)


_hosted: dict[int, object] = {}
"""Stores `host_rendezvous` bound in this process, by port, until `rendezvous` takes them as rank 0's."""


def host_rendezvous(host: str, port: int) -> int:
    """Bind the TCP store this process (at `host`) will host as rank 0 of a group, on `port` (0: one the OS picks
    while binding, so no other process can take it between the choice and the bind), and return the port it holds:
    the others are told it, and `rendezvous(host, port, 0, ...)` here uses this store. A fixed port still held (by a
    group not closed) fails here, naming it."""
    try:
        store = torch.distributed.TCPStore(host, port, None, True, wait_for_workers=False)
    except RuntimeError as err:
        raise JoinError(f"cannot host a rendezvous on port {port}: {err} (a fixed port must be free on this node, "
                        "and a group formed again must close its previous one first)") from err
    _hosted[store.port] = store
    return store.port


VERDICT_GRACE_S = 10.0
"""How much longer than the start-up timeout a joined rank waits for rank 0's verdict: rank 0 gives its verdict
when its own timeout runs out, which a rank that started the same moment would otherwise race."""


def rendezvous(host: str, port: int, rank: int, world: int, timeout_s: float, what: str):
    """A TCP store every rank of a `world`-rank group registers in; returns it once all have, else raises JoinError
    naming the ranks missing after `timeout_s` (rank 0 hosts the store and decides; the others read its verdict)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = _hosted.pop(port, None) if rank == 0 else None
        if store is not None:  # bound ahead by `host_rendezvous`
            store.set_timeout(timeout)
        else:
            store = torch.distributed.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    except RuntimeError as err:
        raise JoinError(f"{what}: rank {rank} could not reach the rendezvous at {host}:{port} within {timeout_s:g} s "
                        f"({err})") from err
    store.set(JOIN_KEY.format(rank), socket.gethostname())
    if rank == 0:
        keys = [JOIN_KEY.format(r) for r in range(world)]
        try:
            store.wait(keys, timeout)
        except RuntimeError:
            missing = [r for r in range(world) if not store.check([JOIN_KEY.format(r)])]
            store.set(VERDICT_KEY, "missing " + " ".join(map(str, missing)))
            raise JoinError(f"{what}: rank(s) {missing} of {world} did not join within {timeout_s:g} s "
                            f"(backend.init_timeout_s); ranks that did: "
                            f"{[r for r in range(world) if r not in missing]}") from None
        store.set(VERDICT_KEY, "ok")
    else:
        try:  # rank 0 decides only once its own timeout has run, which started no later than this rank's
            store.wait([VERDICT_KEY], timeout + timedelta(seconds=VERDICT_GRACE_S))
        except RuntimeError:
            raise JoinError(f"{what}: rank {rank} joined, but rank 0 did not confirm the group within "
                            f"{timeout_s:g} s (backend.init_timeout_s)") from None
        verdict = store.get(VERDICT_KEY).decode()
        if verdict != "ok":
            raise JoinError(f"{what}: rank {rank} joined, but the group did not form: rank(s) "
                            f"{verdict.removeprefix('missing ')} of {world} never arrived")
    return store


def start_process_group(rank: int, world: int, local_rank: int, host: str, port: int, timeout_s: float) -> str:
    """Join the default torch.distributed group (gloo on CPUs, NCCL on GPUs, the GPU chosen by `local_rank`), with
    `timeout_s` for the rendezvous and every later collective; then all-reduce a one on the backend's device to
    prove every rank is in. Returns the backend. Sets the torch.distributed environment for libraries that read it."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))
    backend = collective_backend()
    if dist.is_initialized():
        return dist.get_backend()
    device = collective_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = rendezvous(host, port, rank, world, timeout_s, "trainer process group")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    if int(ones.item()) != world:
        raise JoinError(f"trainer process group: rank {rank} counted {int(ones.item())} of {world} ranks")
    return backend
