"""The weight-update group: a torch.distributed process group of its own (not the default group, so it never
disturbs the trainer's or vLLM's) from the rank that owns the exported buckets (rank 0) to every generator worker.

    sender (rank 0):   for each bucket: broadcast [header bytes, payload bytes] -> header -> payload; then an end mark
    receivers:         the same broadcasts, the payload split back into (hf_name, tensor) views, bucket by bucket

The header is JSON (names, dtypes, shapes); the payload is the bucket's tensors, cast to the dtype the engines serve,
laid end to end as bytes. Nothing is written to a file or put in an object store; the sender holds the bucket it is
given and one payload buffer it casts the bucket into, a receiver one received bucket. gloo carries host tensors,
NCCL device tensors (`collective_device`); a tensor on the wrong device for the group's backend is refused before
the collective. Used by the Ray trainer and engine actors and by the vLLM worker extension (each vLLM worker is a
receiver), so an engine of tensor parallel size N is N receivers. Every member is made by `open_weight_group`, which
maps the transport's name to the class that carries it (`GROUPS`).

CUDA IPC (`CudaIpcWeightGroup`), for a trainer and an engine that share one GPU (colocated placement), so that a
bucket need not move:

    sender:     cast the bucket into one device buffer -> broadcast [header bytes, handle bytes] -> header -> the
                buffer's CUDA IPC handle -> wait until every receiver acknowledges -> free the buffer
    receivers:  open the handle (a view of the sender's memory, no copy), hand the bucket to the loader, which
                copies it into the engine's weights on the same GPU, then acknowledge

Its group is a gloo group carrying only headers, handles and acknowledgements, so the weights cross no host memory
and no network; the acknowledgement keeps the sender from freeing a buffer a receiver is still reading. A handle
only opens in another process on the same physical GPU: the placement decides when it applies.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from .process_groups import collective_backend, collective_device, local_device, rendezvous

END, ABORT = -1, -2
"""Header marks: the refit is complete; the sender failed mid-stream (the receivers raise instead of waiting)."""


class RefitAborted(RuntimeError):
    """The sender failed while streaming; what the receivers loaded of this refit is incomplete."""


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight group: unknown dtype {name!r}")
    return dtype


def bucket_views(header: bytes, payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Split a received payload back into (hf_name, tensor) views, as its JSON header lays them out end to end."""
    bucket, offset = [], 0
    for name, dtype, shape in json.loads(header.decode()):
        dt = dtype_of(dtype)
        size = torch.empty((), dtype=dt).element_size()
        nbytes = torch.Size(shape).numel() * size
        part = payload[offset:offset + nbytes]
        if offset % size:  # laid end to end after a tensor of a smaller dtype: a view would be misaligned
            part = part.clone()
        bucket.append((name, part.view(dt).view(shape)))
        offset += nbytes
    return bucket


class WeightGroup:
    """One member (`rank` of `world`) of a weight-update group rendezvousing at `host:port` (rank 0 hosts it).
    `backend`: gloo or nccl (None: nccl where there is a GPU); `timeout_s` bounds the start-up and each bucket."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, backend: str | None = None,
                 local_rank: int = 0):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self._payload: torch.Tensor | None = None
        self.backend = backend or collective_backend()
        self.device = collective_device(self.backend, local_rank)
        self.store = rendezvous(host, port, rank, world, timeout_s, "weight-update group")
        prefixed = dist.PrefixStore("megatron_spec/weights", self.store)
        timeout = timedelta(seconds=timeout_s)
        if self.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        if tensor.device != self.device:
            raise RuntimeError(f"weight group ({self.backend}): a tensor on {tensor.device} where {self.device} is "
                               "needed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], dtype: torch.dtype | None = None) -> int:
        """Rank 0: stream `buckets` to every receiver, floating tensors cast to `dtype` (None: as they are); returns
        the bytes sent (in the sent dtype). Each bucket is cast straight into one payload buffer, reused from bucket
        to bucket (grown to the largest), so the sender holds the bucket it is given plus one payload."""
        if self.rank != 0:
            raise RuntimeError("weight group: only rank 0 sends")
        total = 0
        try:
            for bucket in buckets:
                total += self._send_bucket(bucket, dtype)
                del bucket  # not held while the next one is made
        except BaseException:
            self._broadcast(torch.tensor([ABORT, 0], dtype=torch.int64, device=self.device))
            raise
        finally:
            self._payload = None
        self._broadcast(torch.tensor([END, 0], dtype=torch.int64, device=self.device))
        return total

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> int:
        """Broadcast one bucket: sizes, the JSON header, then the payload (the tensors' bytes end to end, in the
        sent dtype) written into the send's payload buffer. Returns the payload's bytes."""
        sent = [dtype if dtype is not None and t.is_floating_point() else t.dtype for _, t in bucket]
        header = json.dumps([[name, str(dt), list(t.shape)] for (name, t), dt in zip(bucket, sent)])
        sizes = [t.numel() * torch.empty((), dtype=dt).element_size() for (_, t), dt in zip(bucket, sent)]
        n_payload = sum(sizes)
        if self._payload is None or self._payload.numel() < n_payload:
            self._payload = None  # the old one is released before the larger one is made
            self._payload = torch.empty(n_payload, dtype=torch.uint8, device=self.device)
        payload, offset = self._payload[:n_payload], 0
        with torch.no_grad():
            for (_, t), dt, n in zip(bucket, sent, sizes):
                dst = payload[offset:offset + n]
                if offset % torch.empty((), dtype=dt).element_size() == 0:
                    dst.view(dt).view(t.shape).copy_(t.detach())  # cast and copy in one pass
                else:  # a view at this offset would be misaligned for dt: stage this one tensor
                    dst.copy_(t.detach().to(device=self.device, dtype=dt).contiguous().reshape(-1).view(torch.uint8))
                offset += n
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([head.numel(), n_payload], dtype=torch.int64, device=self.device))
        self._broadcast(head)
        self._broadcast(payload)
        return n_payload

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receivers: the buckets as they arrive, each a list of (hf_name, tensor) views of one received buffer
        (valid until the next bucket is requested: loaders copy them). Must be drained to the end."""
        while (frame := self._receive_frame()) is not None:
            head, payload = frame
            yield bucket_views(head, payload)

    def _receive_frame(self) -> tuple[bytes, torch.Tensor] | None:
        """One frame as the sender broadcasts it: [header bytes, body bytes], the JSON header, the body; None at
        the end mark, RefitAborted at the abort mark."""
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        self._broadcast(sizes)
        n_head, n_body = sizes.tolist()
        if n_head == END:
            return None
        if n_head == ABORT:
            raise RefitAborted("weight group: the sender failed mid-refit; this refit is incomplete")
        head = torch.empty(n_head, dtype=torch.uint8, device=self.device)
        self._broadcast(head)
        body = torch.empty(n_body, dtype=torch.uint8, device=self.device)
        self._broadcast(body)
        return bytes(head.cpu().tolist()), body

    def close(self) -> None:
        self.pg = None
        self.store = None


_DEVICE_ARG = 6
"""Index of the storage's device in the arguments `torch.multiprocessing.reductions.reduce_tensor` gives for a CUDA
tensor: the sender's device index, which the receiver replaces with its own (each process may number the shared GPU
differently, e.g. under CUDA_VISIBLE_DEVICES)."""


class CudaIpcWeightGroup(WeightGroup):
    """A member of a weight-update group whose members all sit on one GPU (`WeightGroup`'s `send` / `receive`)."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, backend: str = "cuda_ipc",
                 local_rank: int = 0):
        if backend != "cuda_ipc":
            raise ValueError(f"CudaIpcWeightGroup carries cuda_ipc, not {backend!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc refit transport needs CUDA: trainer and engine sharing one GPU")
        super().__init__(host, port, rank, world, timeout_s, "gloo", local_rank)
        self.gpu = local_device(local_rank)
        self.backend = "cuda_ipc"

    def _ack(self) -> None:
        """Every member has finished with the current bucket (a gloo all-reduce of one element)."""
        import torch.distributed as dist

        self.pg.allreduce([torch.zeros(1)], dist.AllreduceOptions()).wait()

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = [t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
                   for _, t in bucket]
        header = json.dumps([[name, str(t.dtype), list(t.shape)] for (name, _), t in zip(bucket, tensors)])
        payload = torch.cat([t.to(self.gpu).contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        torch.cuda.current_stream(self.gpu).synchronize()  # the buffer is complete before another process reads it
        _, args = reduce_tensor(payload)
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        handle = torch.frombuffer(bytearray(pickle.dumps(args)), dtype=torch.uint8)
        self._broadcast(torch.tensor([head.numel(), handle.numel()], dtype=torch.int64))
        self._broadcast(head)
        self._broadcast(handle)
        self._ack()  # the receivers have copied it: the buffer may go
        nbytes = payload.numel()
        del payload
        torch.cuda.ipc_collect()  # release the memory torch keeps for buffers shared with other processes
        return nbytes

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets as views of the sender's buffers (valid until the next bucket is requested: loaders copy
        them). Must be drained to the end."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        while (frame := self._receive_frame()) is not None:  # the body is the buffer's IPC handle
            head, handle = frame
            args = list(pickle.loads(handle.numpy().tobytes()))
            args[_DEVICE_ARG] = self.gpu.index
            payload = rebuild_cuda_tensor(*args)
            bucket = bucket_views(head, payload)
            yield bucket
            torch.cuda.current_stream(self.gpu).synchronize()  # the loader's copies out of the buffer are done
            del bucket, payload
            self._ack()


GROUPS = {"gloo": WeightGroup, "nccl": WeightGroup, "cuda_ipc": CudaIpcWeightGroup}
"""Weight-update group classes by transport name; each takes WeightGroup's constructor arguments."""


def open_weight_group(host: str, port: int, rank: int, world: int, timeout_s: float, backend: str | None = None,
                      local_rank: int = 0):
    """Join a weight-update group as `rank` of `world` over `backend` (one of GROUPS; None: nccl where there is a
    GPU, else gloo). Every member of one group must name the same backend."""
    backend = backend or collective_backend()
    if backend not in GROUPS:
        raise ValueError(f"weight group: unknown transport {backend!r} (one of {', '.join(GROUPS)})")
    return GROUPS[backend](host, port, rank, world, timeout_s, backend, local_rank=local_rank)
