"""How a refit travels from the trainer group to the engines (`backend.refit_transport`).

- `collective` (default): one weight-update group (`distributed/weight_group.py`) whose senders are the trainer's
  pipeline stages (one rank each, holding only its own stage's gathered weights: a Megatron trainer of PP size P
  has P senders, the embedded trainer one) and whose receivers are every engine worker (an engine of vLLM tensor
  parallel size N takes N ranks). Buckets of `backend.refit_bucket_mb` are packed and stream in the dtype the
  engines serve, the layout sent once per group; no file, no object store. NCCL between separate GPUs; colocated
  on GPUs, CUDA IPC handles from each trainer rank to the engine worker on its GPU (then every engine worker has a
  sender of its own, the trainer rank it shares a GPU with); gloo on CPUs and for colocated layouts with an engine
  worker on a GPU no trainer rank has (`weight_backend`). The group is formed once; when an engine is replaced it
  is formed again and the current weights resent.
- `object_store` (fallback): rank 0 puts size-bounded buckets in Ray's object store, every engine fetches them.

With engines of TP > 1 the group is sharded (`backend.refit_shard_receivers`): each sender has one process group
per TP rank r, {sender, worker r of every engine}, and cuts each tensor as vLLM's loader does for rank r
(`tp_cut`), so a worker receives about 1/TP of the model (replicated tensors and drafters whole) and a sender sends
the model once plus the replicated tensors once more per extra rank.

Both answer `start(version)` with [senders' result, engine 0, ...] results or futures: the senders' (bytes put on
the wire, seconds, `SendInfo`), each engine's (bytes its busiest worker received, seconds); `sync_metrics` turns them into the step's `weight_sync_*`
metrics: bytes, seconds, GB/s, transport, senders, the busiest sender's bytes, the most any trainer rank received
while gathering, and how long the senders waited for the engines (`weight_sync_wait_s`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..rl.loop import REFIT_BUCKET_BYTES
from . import require_ray

GPU_BUCKET_MB = 512
"""Refit bucket on GPUs: large enough that NCCL runs at the link's bandwidth, two of them a small part of a GPU."""
CPU_BUCKET_MB = 64
"""Refit bucket on CPUs: what `benchmarks/refit_collective.py` measured best on gloo (its sweep is in its record)."""


@dataclass
class SendInfo:
    """What the trainer side of one refit did: pipeline-stage senders, the bytes of the busiest, the most any
    trainer rank received while the stages gathered their buckets, and the longest a sender waited at the opening
    of the refit for every engine worker to arrive."""

    senders: int
    sender_bytes_max: int
    received_bytes_max: int
    wait_s: float


def bucket_bytes(cfg, placement) -> int:
    """The refit bucket in bytes: `backend.refit_bucket_mb`, or the default for the engines' devices."""
    mb = cfg.backend.refit_bucket_mb or (GPU_BUCKET_MB if placement.bundle.get("GPU", 0) else CPU_BUCKET_MB)
    return mb << 20


def weight_senders(cfg, backend: str | None = None, placement=None) -> int:
    """Senders of the collective refit: with `cuda_ipc` one per engine worker (trainer rank u serves the engine
    worker on its GPU, `Placement.gpu_peer`); otherwise one per pipeline stage of a Megatron trainer, else one."""
    if backend == "cuda_ipc":
        return placement.generators * placement.engine_tp
    return cfg.backend.megatron.pp if cfg.backend.trainer == "megatron" else 1


def resolve(pending: list) -> list[tuple]:
    ray = require_ray()
    return [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in pending]


def weight_backend(placement) -> str:
    """The one place the collective refit's transport is chosen (a name of `weight_group.GROUPS`):

    - NCCL between separate GPUs (disaggregated);
    - CUDA IPC when every engine worker shares its GPU with a trainer rank (colocated, one bundle per GPU, at least
      as many trainer ranks as engine workers, engines of any TP): trainer rank u holds the whole refit stream
      (a Megatron trainer's stages broadcast their buckets to every rank over its own group, NVLink inside a
      node) and hands each bucket to the engine worker on its GPU as an IPC handle, so the weights never leave the
      device (the paired group of `weight_group`);
    - gloo on CPUs, and colocated where some engine worker's GPU has no trainer rank (more engine workers than
      trainer ranks, e.g. one embedded trainer rank and an engine of TP 2): an IPC handle only opens on the GPU it
      was made on, and two ranks on one GPU cannot share an NCCL group, so that worker must take its buckets
      through host memory."""
    gpus = placement.bundle.get("GPU", 0)
    if gpus and placement.kind == "disaggregated":
        return "nccl"
    workers = placement.generators * placement.engine_tp
    if gpus and all(placement.gpu_peer(u) is not None for u in range(workers)):
        return "cuda_ipc"
    return "gloo"


class ObjectStoreRefit:
    name = "object_store"

    def __init__(self, cfg, trainer, generator):
        self.trainer, self.generator = trainer, generator

    def start(self, version: int) -> list:
        refs, nbytes, export_s = self.trainer.export(REFIT_BUCKET_BYTES)
        return [(nbytes, export_s, SendInfo(1, nbytes, 0, 0.0)), *self.generator.sync(version, refs)]

    def seconds(self, results: list[tuple]) -> float:
        """Export, then the slowest engine's fetch and load."""
        return results[0][1] + max((r[1] for r in results[1:]), default=0.0)


class CollectiveRefit:
    name = "collective"

    def __init__(self, cfg, trainer, generator):
        self.cfg, self.trainer, self.generator = cfg, trainer, generator
        self.backend = weight_backend(generator.placement)
        self.senders = weight_senders(cfg, self.backend, generator.placement)
        self.bucket_bytes = bucket_bytes(cfg, generator.placement)
        self.dtype: str | None = None
        self.version: int | None = None
        generator.reconnect = self.reconnect
        self.connect()

    def connect(self) -> None:
        """Form the weight-update group: the senders (trainer rank 0, which hosts the rendezvous, announces the
        join to the other stages' senders), then each engine's workers in engine order. Fails naming the engines
        that did not join within `backend.init_timeout_s`."""
        ray = require_ray()
        timeout = self.cfg.backend.init_timeout_s
        sender = self.trainer.ranks[0]
        host, port, _ = ray.get(sender.address.remote())
        sizes = ray.get([e.weight_ranks.remote() for e in self.generator.engines])
        shard = self.shard_geometry()
        world = self.senders + sum(sizes)
        joins = [sender.join_weights.remote(host, port, world, timeout, self.backend, self.senders, shard)]
        base = self.senders
        for engine, n in zip(self.generator.engines, sizes):
            joins.append(engine.join_weights.remote(host, port, world, base, timeout, self.backend, self.senders,
                                                    shard))
            base += n
        ready, _ = ray.wait(joins, num_returns=len(joins), timeout=timeout + 30)
        if len(ready) < len(joins):
            late = [i - 1 for i, ref in enumerate(joins) if ref not in ready]
            raise RuntimeError(f"weight-update group: {'the trainer' if -1 in late else f'engine(s) {late}'} did not "
                               f"join within backend.init_timeout_s={timeout:g} s")
        dtypes = set(ray.get(joins)[1:])
        if len(dtypes) != 1:
            raise RuntimeError(f"engines serve different dtypes {sorted(dtypes)}: one refit stream cannot feed them")
        self.dtype = dtypes.pop()

    def shard_geometry(self) -> dict | None:
        """The group's sharded mode (`backend.refit_shard_receivers`): the engines' common cut geometry, None when
        their workers take whole tensors (TP 1, our engine, the option off, or CUDA IPC's paired whole stream)."""
        if not self.cfg.backend.refit_shard_receivers or self.backend == "cuda_ipc":
            return None
        shards = require_ray().get([e.weight_shard.remote() for e in self.generator.engines])
        if any(s != shards[0] for s in shards):
            raise RuntimeError(f"engines report different tensor-parallel cuts {shards}: one sharded refit cannot "
                               "feed them (set backend.refit_shard_receivers=false)")
        return shards[0]

    def start(self, version: int) -> list:
        """Stream the weights of `version` to every engine; the futures of the sender and each engine."""
        self.version = version
        send = self.trainer.ranks[0].send_weights.remote(self.bucket_bytes, self.dtype)
        return [send, *[self.generator.beside(e, "receive_weights").remote(version)
                        for e in self.generator.engines]]

    def reconnect(self) -> None:
        """After an engine was replaced: form the group again and resend the last sent version (the trainer holds
        it: refits happen only when the driver is about to generate, before the next update). The old group is
        closed first: its store holds the port (a fixed one, `weights_port`) the new group's rendezvous binds."""
        require_ray().get(self.trainer.ranks[0].close_weights.remote())
        self.connect()
        if self.version is not None:
            resolve(self.start(self.version))

    def seconds(self, results: list[tuple]) -> float:
        """Sending and loading overlap: the slowest side."""
        return max(r[1] for r in results)


TRANSPORTS = {"collective": CollectiveRefit, "object_store": ObjectStoreRefit}


def sync_metrics(transport, results: list[tuple]) -> dict:
    """The step's `weight_sync_*` metrics from the senders' result (first) and the engines'."""
    nbytes, seconds = results[0][0], transport.seconds(results)
    info = results[0][2] if len(results[0]) > 2 else SendInfo(1, nbytes, 0, 0.0)
    return {"weight_sync_bytes": nbytes, "weight_sync_s": seconds,
            "weight_sync_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "weight_sync_transport": transport.name,
            **{f"weight_sync_{k}": v for k, v in asdict(info).items()}}
