"""How a refit travels from the trainer group to the engines (`backend.refit_transport`).

- `collective` (default): one weight-update group (`backends/weight_group.py`): trainer rank 0, which holds each
  bucket as the export gathers it, is the sender; every engine worker is a receiver (an engine of vLLM tensor
  parallel size N takes N ranks). Buckets stream in the dtype the engines serve; no file, no object store. gloo on
  CPUs and for colocated GPUs (two ranks on one GPU cannot share an NCCL group), CUDA IPC handles when the trainer
  and a single engine share one GPU, NCCL between separate GPUs (`weight_backend`). The
  group is formed once; when an engine is replaced it is formed again and the current weights resent.
- `object_store` (fallback): rank 0 puts size-bounded buckets in Ray's object store, every engine fetches them.

Both answer `start(version)` with [sender, engine 0, ...] results or futures of (bytes, seconds); `finish` resolves
them into the step's `weight_sync_*` metrics: bytes, seconds, GB/s and the transport's name.
"""

from __future__ import annotations

from ...rl.loop import REFIT_BUCKET_BYTES
from . import require_ray


def resolve(pending: list) -> list[tuple[int, float]]:
    ray = require_ray()
    return [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in pending]


def weight_backend(placement) -> str:
    """The one place the collective refit's transport is chosen (a name of `weight_group.GROUPS`): NCCL between
    separate GPUs; CUDA IPC when the one engine worker shares the sender's GPU (colocated on one GPU: the buckets
    never leave the device); gloo on CPUs and for the other colocated layouts (two ranks on one GPU cannot share an
    NCCL group, and an IPC handle only opens on the GPU it was made on)."""
    gpus = placement.bundle.get("GPU", 0)
    if gpus and placement.kind == "disaggregated":
        return "nccl"
    if gpus and placement.generators * placement.engine_tp == 1:
        return "cuda_ipc"
    return "gloo"


class ObjectStoreRefit:
    name = "object_store"

    def __init__(self, cfg, trainer, generator):
        self.trainer, self.generator = trainer, generator

    def start(self, version: int) -> list:
        refs, nbytes, export_s = self.trainer.export(REFIT_BUCKET_BYTES)
        return [(nbytes, export_s), *self.generator.sync(version, refs)]

    def seconds(self, results: list[tuple[int, float]]) -> float:
        """Export, then the slowest engine's fetch and load."""
        return results[0][1] + max((s for _, s in results[1:]), default=0.0)


class CollectiveRefit:
    name = "collective"

    def __init__(self, cfg, trainer, generator):
        self.cfg, self.trainer, self.generator = cfg, trainer, generator
        self.backend = weight_backend(generator.placement)
        self.dtype: str | None = None
        self.version: int | None = None
        generator.reconnect = self.reconnect
        self.connect()

    def connect(self) -> None:
        """Form the weight-update group: rank 0 on trainer rank 0, then each engine's workers in engine order.
        Fails naming the engines that did not join within `backend.init_timeout_s`."""
        ray = require_ray()
        timeout = self.cfg.backend.init_timeout_s
        sender = self.trainer.ranks[0]
        host, port, _ = ray.get(sender.address.remote())
        sizes = ray.get([e.weight_ranks.remote() for e in self.generator.engines])
        world = 1 + sum(sizes)
        joins = [sender.join_weights.remote(host, port, world, timeout, self.backend)]
        base = 1
        for engine, n in zip(self.generator.engines, sizes):
            joins.append(engine.join_weights.remote(host, port, world, base, timeout, self.backend))
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

    def start(self, version: int) -> list:
        """Stream the weights of `version` to every engine; the futures of the sender and each engine."""
        self.version = version
        send = self.trainer.ranks[0].send_weights.remote(REFIT_BUCKET_BYTES, self.dtype)
        return [send, *[e.receive_weights.remote(version) for e in self.generator.engines]]

    def reconnect(self) -> None:
        """After an engine was replaced: form the group again and resend the last sent version (the trainer holds
        it: refits happen only when the driver is about to generate, before the next update)."""
        self.connect()
        if self.version is not None:
            resolve(self.start(self.version))

    def seconds(self, results: list[tuple[int, float]]) -> float:
        """Sending and loading overlap: the slowest side."""
        return max(s for _, s in results)


TRANSPORTS = {"collective": CollectiveRefit, "object_store": ObjectStoreRefit}


def sync_metrics(transport, results: list[tuple[int, float]]) -> dict:
    nbytes, seconds = results[0][0], transport.seconds(results)
    return {"weight_sync_bytes": nbytes, "weight_sync_s": seconds,
            "weight_sync_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "weight_sync_transport": transport.name}

