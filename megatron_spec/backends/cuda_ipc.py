"""Refit over CUDA IPC: the trainer and the engine share one GPU (colocated placement), so a bucket need not move.

    sender:     cast the bucket into one device buffer -> broadcast [header bytes, handle bytes] -> header -> the
                buffer's CUDA IPC handle -> wait until every receiver acknowledges -> free the buffer
    receivers:  open the handle (a view of the sender's memory, no copy), hand the bucket to the loader, which
                copies it into the engine's weights on the same GPU, then acknowledge

The group itself is a small gloo group carrying only headers, handles and acknowledgements, so the weights cross
no host memory and no network; the acknowledgement keeps the sender from freeing or reusing a buffer that a
receiver is still reading. A handle only opens in another process on the same physical GPU: the placement decides
when this transport applies, the weight-update group (`weight_group.py`) otherwise.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator

import torch

from .process_groups import local_device
from .weight_group import ABORT, END, RefitAborted, WeightGroup, bucket_views

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

        while True:
            sizes = torch.empty(2, dtype=torch.int64)
            self._broadcast(sizes)
            n_head, n_handle = sizes.tolist()
            if n_head == END:
                return
            if n_head == ABORT:
                raise RefitAborted("weight group: the sender failed mid-refit; this refit is incomplete")
            head = torch.empty(n_head, dtype=torch.uint8)
            self._broadcast(head)
            handle = torch.empty(n_handle, dtype=torch.uint8)
            self._broadcast(handle)
            args = list(pickle.loads(handle.numpy().tobytes()))
            args[_DEVICE_ARG] = self.gpu.index
            payload = rebuild_cuda_tensor(*args)
            bucket = bucket_views(head.numpy().tobytes(), payload)
            yield bucket
            torch.cuda.current_stream(self.gpu).synchronize()  # the loader's copies out of the buffer are done
            del bucket, payload
            self._ack()
