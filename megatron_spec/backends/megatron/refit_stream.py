"""The refit stream of a sharded Megatron model: HF-named full tensors, one bucket at a time, in the engine's dtype.

The same walk as `exporter.export_buckets` (each pipeline stage in turn; per bucket one gather over TP, ETP then EP
among the stage's ranks, then a broadcast to the other stages), with two differences that bound what a refit
costs the ranks:

- Buckets are sized for the refit (`bucket_bytes`, the weight-update group's bucket), not for a checkpoint export
  (512 MiB, which on a small model is the whole model), so a rank holds a few buckets beyond its shards.
- Each bucket's shards are cast to `dtype` (the dtype the engines serve) *before* they are gathered: an fp32
  trainer refitting a bf16 engine moves and holds half the bytes. Gathering is copying and the HF conversion only
  slices and concatenates, so casting first gives bit for bit the tensors of casting the gathered ones.

What a sending rank holds at once beyond its shards, for buckets of B bytes in `dtype`: this rank's shards of the
bucket being gathered, cast (at most B), the gather buffers (about B: the exporter's pooled send / receive bytes,
or the fresh expert buffers), the HF tensors made from them (at most B; views where nothing was split), what the
caller still holds of the previous bucket (at most B: the trainer re-buckets the stream, so one of its buckets may
end in the next gathered one) and the weight-update group's payload (B): at most about 5 B (5 times the largest
tensor where that is bigger), against the whole model for an export in one bucket. Collective: every rank of
the model's groups must drain the generator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .exporter import _broadcast, _buckets, _entries, _gather, _Pool
from .parallel import ranks


def refit_buckets(model, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Lists of `(hf_name, full tensor)` of at most `bucket_bytes` (in `dtype`; a larger tensor goes alone), every
    floating tensor in `dtype` (None: the parameters' own). Every rank yields the same buckets. Collective."""
    if bucket_bytes <= 0:
        raise ValueError(f"refit bucket size must be positive, got {bucket_bytes}")
    r = ranks()
    entries = [_in_dtype(e, dtype) for e in _entries(model, r)]
    cfg, pool = model.hf_config, _Pool()
    for stage in range(r.pp):
        src = dist.get_global_rank(r.pp_group, stage) if r.pp > 1 else None
        if r.pp_rank == stage:
            for bucket in _buckets(entries, bucket_bytes):
                items = _gather([_cast(e, dtype) for e in bucket], cfg, r, pool)
                if r.pp > 1:
                    _broadcast(items, src, r.pp_group, model, pool)
                yield items
                items = None  # the next bucket is gathered without this one held here
            if r.pp > 1:
                _broadcast(None, src, r.pp_group, model, pool)
        else:
            while (items := _broadcast(None, src, r.pp_group, model, pool, receive=True)) is not None:
                yield items
                items = None


def _casts(param: Tensor, dtype: torch.dtype | None) -> bool:
    return dtype is not None and param.is_floating_point() and param.dtype != dtype


def _in_dtype(entry, dtype: torch.dtype | None):
    """The entry with its gathered size counted in `dtype`, so buckets are cut by the bytes that travel."""
    if not _casts(entry.param, dtype):
        return entry
    size = torch.empty((), dtype=dtype).element_size()
    return dataclasses.replace(entry, out_bytes=entry.out_bytes // entry.param.element_size() * size)


@torch.no_grad()
def _cast(entry, dtype: torch.dtype | None):
    """The entry with this rank's shard as a `dtype` copy (made per bucket: only one bucket's copies live)."""
    if not _casts(entry.param, dtype):
        return entry
    return dataclasses.replace(entry, param=entry.param.detach().to(dtype))
