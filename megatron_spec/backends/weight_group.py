"""The weight-update group: a torch.distributed process group of its own (not the default group, so it never
disturbs the trainer's or vLLM's) from the rank that owns the exported buckets (rank 0) to every generator worker.

    sender (rank 0):   for each bucket: broadcast [header bytes, payload bytes] -> header -> payload; then an end mark
    receivers:         the same broadcasts, the payload split back into (hf_name, tensor) views, bucket by bucket

The header is JSON (names, dtypes, shapes); the payload is the bucket's tensors, cast to the dtype the engines serve,
laid end to end as bytes. Nothing is written to a file or put in an object store, and neither side ever holds more
than one bucket. gloo carries host tensors, NCCL device tensors (`collective_device`); a tensor on the wrong device
for the group's backend is refused before the collective. Used by the Ray trainer and engine actors and by the
vLLM worker extension (each vLLM worker is a receiver), so an engine of tensor parallel size N is N receivers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from .process_groups import collective_backend, collective_device, rendezvous

END, ABORT = -1, -2
"""Header marks: the refit is complete; the sender failed mid-stream (the receivers raise instead of waiting)."""


class RefitAborted(RuntimeError):
    """The sender failed while streaming; what the receivers loaded of this refit is incomplete."""


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight group: unknown dtype {name!r}")
    return dtype


class WeightGroup:
    """One member (`rank` of `world`) of a weight-update group rendezvousing at `host:port` (rank 0 hosts it).
    `backend`: gloo or nccl (None: nccl where there is a GPU); `timeout_s` bounds the start-up and each bucket."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, backend: str | None = None,
                 local_rank: int = 0):
        import torch.distributed as dist

        self.rank, self.world = rank, world
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
        the bytes sent (in the sent dtype)."""
        if self.rank != 0:
            raise RuntimeError("weight group: only rank 0 sends")
        total = 0
        try:
            for bucket in buckets:
                total += self._send_bucket(bucket, dtype)
        except BaseException:
            self._broadcast(torch.tensor([ABORT, 0], dtype=torch.int64, device=self.device))
            raise
        self._broadcast(torch.tensor([END, 0], dtype=torch.int64, device=self.device))
        return total

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> int:
        tensors = [t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
                   for _, t in bucket]
        header = json.dumps([[name, str(t.dtype), list(t.shape)] for (name, _), t in zip(bucket, tensors)])
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8).to(self.device)
        payload = torch.cat([t.to(self.device).contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        self._broadcast(torch.tensor([head.numel(), payload.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(head)
        self._broadcast(payload)
        return payload.numel()

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receivers: the buckets as they arrive, each a list of (hf_name, tensor) views of one received buffer
        (valid until the next bucket is requested: loaders copy them). Must be drained to the end."""
        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            self._broadcast(sizes)
            n_head, n_payload = sizes.tolist()
            if n_head == END:
                return
            if n_head == ABORT:
                raise RefitAborted("weight group: the sender failed mid-refit; this refit is incomplete")
            head = torch.empty(n_head, dtype=torch.uint8, device=self.device)
            self._broadcast(head)
            payload = torch.empty(n_payload, dtype=torch.uint8, device=self.device)
            self._broadcast(payload)
            bucket, offset = [], 0
            for name, dtype, shape in json.loads(bytes(head.cpu().tolist()).decode()):
                dt = dtype_of(dtype)
                numel = 1
                for s in shape:
                    numel *= s
                nbytes = numel * torch.empty((), dtype=dt).element_size()
                bucket.append((name, payload[offset:offset + nbytes].view(dt).view(shape)))
                offset += nbytes
            yield bucket

    def close(self) -> None:
        self.pg = None
        self.store = None
