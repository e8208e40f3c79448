"""This rank's shards -> `(hf_name, full_tensor)` for the whole model, in size-bounded buckets, on every rank.

For each pipeline stage in turn, the stage's ranks gather each bucket of parameters (one flat all-gather per
group and bucket: TP for dense tensors, ETP then EP for experts), turn full Megatron tensors into HF tensors
(split QKV and gate/up, trim the vocabulary padding, global layer and expert ids), and broadcast the bucket to the
other stages. So every rank yields the same sequence of buckets, and every rank must drain the generator: the
collectives run as it is iterated. Tensors may alias the model's parameters when nothing had to be gathered;
clone them to keep a snapshot across optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from . import require_megatron
from .importer import chunks_of, layer_offset
from .mapping import (
    ParamSpec, from_megatron, from_megatron_shards, global_expert, megatron_to_hf, unshard,
)
from .parallel import Ranks, ranks

require_megatron()

DEFAULT_BUCKET_BYTES = 512 * 2**20
_ALIGN = 16  # byte offsets of tensors inside a flat buffer stay aligned for any dtype


@dataclass
class _Entry:
    name: str
    param: Tensor
    spec: ParamSpec
    out_bytes: int


def export_hf(model, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, Tensor]]:
    """Every HF-named full tensor of `model` (policy, then MTP layers with our drafter's names; a list of model
    chunks: chunk by chunk). Collective."""
    for bucket in export_buckets(model, bucket_bytes):
        yield from bucket


def export_buckets(model, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """Lists of `(hf_name, full_tensor)` of at most `bucket_bytes` each (a larger tensor goes alone); with virtual
    pipeline stages chunk by chunk (every rank walks its chunk v together: each chunk's layers are global, so
    the walk is the same per chunk). Collective."""
    for chunk in chunks_of(model):
        yield from _chunk_buckets(chunk, bucket_bytes)


def _chunk_buckets(model, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    r = ranks()
    entries = _entries(model, r)
    cfg, pool = model.hf_config, _Pool()
    for stage in range(r.pp):
        src = dist.get_global_rank(r.pp_group, stage) if r.pp > 1 else None
        if r.pp_rank == stage:
            for bucket in _buckets(entries, bucket_bytes):
                items = _gather(bucket, cfg, r, pool)
                if r.pp > 1:
                    _broadcast(items, src, r.pp_group, model, pool)
                yield items
            if r.pp > 1:
                _broadcast(None, src, r.pp_group, model, pool)
        else:
            while (items := _broadcast(None, src, r.pp_group, model, pool, receive=True)) is not None:
                yield items


# ---------------------------------------------------------------------------------------------------------------


def _entries(model, r: Ranks) -> list[_Entry]:
    offset, tied = layer_offset(model), model.hf_config.tie_word_embeddings
    out = []
    for name, p in model.named_parameters():
        spec = megatron_to_hf(name, offset, first_stage=model.pre_process, tied=tied)
        if not spec.export:
            continue
        split = 1 if spec.kind == "replicated" else (r.etp if spec.is_expert else r.tp)
        copies = r.ep if spec.is_expert else 1
        out.append(_Entry(name, p, spec, p.numel() * p.element_size() * split * copies))
    return out


def _buckets(entries: list[_Entry], limit: int) -> Iterator[list[_Entry]]:
    bucket, size = [], 0
    for e in entries:
        if bucket and size + e.out_bytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(e)
        size += e.out_bytes
    if bucket:
        yield bucket


@torch.no_grad()
def _gather(bucket: list[_Entry], cfg, r: Ranks, pool: "_Pool") -> list[tuple[str, Tensor]]:
    dense = [e for e in bucket if not e.spec.is_expert]
    experts = [e for e in bucket if e.spec.is_expert]
    # Dense: TP-split tensors gathered over TP (into reusable buffers: the HF tensors are fresh concatenations).
    split = [e for e in dense if e.spec.kind != "replicated" and r.tp > 1]
    shards = dict(zip([e.name for e in split], _all_gather([e.param for e in split], r.tp_group, r.tp, pool)))
    items = []
    for e in dense:
        hf = from_megatron_shards(e.spec, shards.get(e.name, [e.param.detach()]), cfg)
        items += zip(e.spec.names(), hf)
    if not experts:
        return items
    # Experts: whole experts over ETP, then every EP rank's experts (fresh buffers: the HF tensors view them).
    split = [e for e in experts if r.etp > 1]
    gathered = _all_gather([e.param for e in split], r.etp_group, r.etp, pool)
    whole = {e.name: unshard(e.spec, s) for e, s in zip(split, gathered)}
    tensors = [whole.get(e.name, e.param.detach()) for e in experts]
    per_rank = _all_gather(tensors, r.ep_group, r.ep, pool, reuse_received=False) if r.ep > 1 else [[t] for t in tensors]
    for e, by_rank in zip(experts, per_rank):
        for ep_rank, t in enumerate(by_rank):
            g = global_expert(e.spec.local_expert, ep_rank, cfg.num_experts, r.ep)
            items += zip(e.spec.names(g), from_megatron(e.spec, t, cfg, r.etp))
    return items


class _Pool:
    """Byte buffers reused from bucket to bucket for data that no yielded tensor points into."""

    def __init__(self):
        self.buffers: dict = {}

    def get(self, key, nbytes: int, device) -> Tensor:
        b = self.buffers.get(key)
        if b is None or b.numel() < nbytes or b.device != torch.device(device):
            b = self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return b[:nbytes]


def _nbytes(shape, dtype) -> int:
    """Bytes a tensor takes inside a flat buffer (rounded up so every tensor starts aligned for any dtype)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return -(-n // _ALIGN) * _ALIGN


def _layout(like: list[tuple]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for shape, dtype in like:
        offsets.append(total)
        total += _nbytes(shape, dtype)
    return offsets, total


def _pack(tensors: list[Tensor], out: Tensor, offsets: list[int]) -> Tensor:
    for t, o in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        out[o : o + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return out


def _unpack(flat: Tensor, offsets: list[int], like: list[tuple]) -> list[Tensor]:
    out = []
    for o, (shape, dtype) in zip(offsets, like):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(flat[o : o + n].view(dtype).view(shape))
    return out


def _all_gather(tensors: list[Tensor], group, size: int, pool: _Pool, reuse_received: bool = True) -> list[list[Tensor]]:
    """For each tensor, the same-shaped tensors of all `size` ranks of `group` in group-rank order (this rank's
    entry is the tensor itself). Received data lands in pooled buffers when `reuse_received`, else fresh ones."""
    if not tensors:
        return []
    device, like = tensors[0].device, [(t.shape, t.dtype) for t in tensors]
    offsets, total = _layout(like)
    send = _pack(tensors, pool.get("send", total, device), offsets)
    me = dist.get_rank(group)

    def recv_buffer(key, nbytes: int) -> Tensor:
        return pool.get(key, nbytes, device) if reuse_received else torch.empty(nbytes, dtype=torch.uint8, device=device)

    if dist.get_backend(group) == "gloo":
        # gloo's all-gather runs several times slower than its broadcast on a 2-process CPU run (measured while
        # writing bench_export), so gather as one broadcast from each rank in turn.
        gathered = [send if q == me else recv_buffer(("recv", q), total) for q in range(size)]
        for q in range(size):
            dist.broadcast(gathered[q], src=dist.get_global_rank(group, q), group=group)
    else:
        out = recv_buffer("recv_all", size * total)
        dist.all_gather_into_tensor(out, send, group=group)
        gathered = list(out.chunk(size))
    by_rank = [None if q == me else _unpack(gathered[q], offsets, like) for q in range(size)]
    return [[tensors[i] if q == me else by_rank[q][i] for q in range(size)] for i in range(len(tensors))]


def _broadcast(items, src: int, group, model, pool: _Pool, receive: bool = False):
    """Send a bucket (or None: end of stage) from `src` to the other pipeline stages; receivers get it back."""
    device = next(model.parameters()).device
    meta = [None if items is None else [(n, t.shape, t.dtype) for n, t in items]]
    dist.broadcast_object_list(meta, src=src, group=group, device=device)
    if meta[0] is None:
        return None
    like = [(shape, dtype) for _, shape, dtype in meta[0]]
    offsets, total = _layout(like)
    if receive:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        flat = _pack([t for _, t in items], pool.get("pp_send", total, device), offsets)
    dist.broadcast(flat, src=src, group=group)
    if not receive:
        return items
    return list(zip([n for n, _, _ in meta[0]], _unpack(flat, offsets, like)))
