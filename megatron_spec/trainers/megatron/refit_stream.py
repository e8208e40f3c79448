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

The refit into engines does not need every stage's weights on one rank: `send_stages` has each pipeline stage
gather only its own buckets (`stage_buckets`: the same gathers, no broadcast between stages) and its first rank
send them into the weight-update group as that stage's sender (`join_stage_sender`), so no rank receives another
stage's weights and the stages send at once, each its own share. The exception is the per-GPU CUDA IPC refit
(`per_gpu`): an engine worker loads whole HF tensors of every stage, and an IPC handle opens only on its own GPU,
so every rank that shares a GPU with an engine worker walks the whole model (`refit_buckets`, the stages'
buckets reaching it over the trainer's own group) and hands it to that worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .exporter import _all_gather, _broadcast, _buckets, _entries, _gather, _layout, _pack, _Pool, _unpack
from .importer import chunks_of
from .mapping import from_megatron, global_expert, unshard
from .parallel import ranks


def refit_buckets(model, bucket_bytes: int, dtype: torch.dtype | None = None,
                  received: list[int] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Lists of `(hf_name, full tensor)` of at most `bucket_bytes` (in `dtype`; a larger tensor goes alone), every
    floating tensor in `dtype` (None: the parameters' own); `model` may be a list of virtual-pipeline chunks, walked
    chunk by chunk. Every rank yields the same buckets (the whole model). `received[0]` counts the bytes this rank
    received: its stage's gathers less its own shards, and the other stages' buckets. Collective."""
    if bucket_bytes <= 0:
        raise ValueError(f"refit bucket size must be positive, got {bucket_bytes}")
    for chunk in chunks_of(model):
        yield from _chunk_refit(chunk, bucket_bytes, dtype, received)


def _chunk_refit(model, bucket_bytes: int, dtype: torch.dtype | None,
                 received: list[int] | None) -> Iterator[list[tuple[str, Tensor]]]:
    r = ranks()
    entries = [_in_dtype(e, dtype) for e in _entries(model, r)]
    cfg, pool = model.hf_config, _Pool()
    for stage in range(r.pp):
        src = dist.get_global_rank(r.pp_group, stage) if r.pp > 1 else None
        if r.pp_rank == stage:
            for bucket in _buckets(entries, bucket_bytes):
                items = _gather(_counted(bucket, dtype, received), cfg, r, pool)
                if r.pp > 1:
                    _broadcast(items, src, r.pp_group, model, pool)
                yield items
                items = None  # the next bucket is gathered without this one held here
            if r.pp > 1:
                _broadcast(None, src, r.pp_group, model, pool)
        else:
            while (items := _broadcast(None, src, r.pp_group, model, pool, receive=True)) is not None:
                if received is not None:
                    received[0] += sum(t.numel() * t.element_size() for _, t in items)
                yield items
                items = None


def _counted(bucket: list, dtype: torch.dtype | None, received: list[int] | None) -> list:
    """The bucket's entries with this rank's shards cast to `dtype`; `received[0]` grows by what the gathers
    bring this rank: each gathered tensor's bytes less its own shard's."""
    cast = [_cast(e, dtype) for e in bucket]
    if received is not None:
        received[0] += sum(e.out_bytes - c.param.numel() * c.param.element_size() for e, c in zip(bucket, cast))
    return cast


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


def stage_buckets(model, bucket_bytes: int, dtype: torch.dtype | None = None,
                  received: list[int] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """This rank's pipeline stage's buckets only (no stage sees another's), whole on the stage's sender
    (`stage_senders`); the other ranks of the stage yield the same dense tensors but no experts: every EP rank
    sends its whole experts (gathered over ETP) to the sender only, and ranks outside the sender's expert group
    take no part in the expert gathers, so no rank receives experts it does not send. `received[0]` counts the
    bytes this rank received while gathering. `model` may be a list of virtual-pipeline chunks. The call finds
    the senders at once (collective over every rank: before a sender blocks in its weight group); the stream is
    collective over the stage's TP and expert groups."""
    if bucket_bytes <= 0:
        raise ValueError(f"refit bucket size must be positive, got {bucket_bytes}")
    r = ranks()
    sender = stage_senders()[r.pp_rank]
    members = dist.get_process_group_ranks(r.ep_group) if r.ep > 1 else []
    to = members.index(sender) if sender in members else None  # the sender's rank in this rank's EP group
    return _stage_stream(model, bucket_bytes, dtype, received, r, to)


def _stage_stream(model, bucket_bytes: int, dtype: torch.dtype | None, received: list[int] | None, r,
                  to: int | None) -> Iterator[list[tuple[str, Tensor]]]:
    chunks = chunks_of(model)
    entries = [_in_dtype(e, dtype) for chunk in chunks for e in _entries(chunk, r)]
    cfg, pool = chunks[0].hf_config, _Pool()
    for bucket in _buckets(entries, bucket_bytes):
        if r.ep == 1:
            items = _gather(_counted(bucket, dtype, received), cfg, r, pool)
        else:
            items = _gather_for_sender(bucket, dtype, cfg, r, pool, to, received)
        yield items
        items = None


def _gather_for_sender(bucket: list, dtype: torch.dtype | None, cfg, r, pool, to: int | None,
                       received: list[int] | None) -> list[tuple[str, Tensor]]:
    """One bucket of a stage with expert parallelism: dense tensors gathered over TP as the export does; experts
    made whole over ETP, then gathered over EP to group rank `to` (the stage's sender) alone, skipped where `to`
    is None (this rank's EP group does not hold the sender). Only rank `to` gets the bucket's experts."""
    dense = [e for e in bucket if not e.spec.is_expert]
    experts = [e for e in bucket if e.spec.is_expert]
    items = _gather(_counted(dense, dtype, received), cfg, r, pool)
    if not experts or to is None:
        return items
    cast = [_cast(e, dtype) for e in experts]
    split = [c for c in cast if r.etp > 1]
    whole = {c.name: unshard(c.spec, s) for c, s in zip(split, _all_gather([c.param for c in split], r.etp_group,
                                                                           r.etp, pool))}
    tensors = [whole.get(c.name, c.param.detach()) for c in cast]
    per_rank = _gather_to(tensors, r.ep_group, r.ep, to)
    if received is not None:
        received[0] += sum(c.param.numel() * c.param.element_size() * (r.etp - 1) for c in split)
        if per_rank is not None:
            received[0] += sum(t.numel() * t.element_size() * (r.ep - 1) for t in tensors)
    if per_rank is None:
        return items
    for c, by_rank in zip(cast, per_rank):
        for ep_rank, t in enumerate(by_rank):
            g = global_expert(c.spec.local_expert, ep_rank, cfg.num_experts, r.ep)
            items += zip(c.spec.names(g), from_megatron(c.spec, t, cfg, r.etp))
    return items


def _gather_to(tensors: list[Tensor], group, size: int, to: int) -> list[list[Tensor]] | None:
    """For each tensor, the same-shaped tensors of all `size` ranks of `group` in group-rank order, on group rank
    `to` only (point to point: no other rank receives anything); None on the others. Received data lands in
    fresh buffers (the HF tensors view them)."""
    device, like = tensors[0].device, [(t.shape, t.dtype) for t in tensors]
    offsets, total = _layout(like)
    me = dist.get_rank(group)
    if me != to:
        dist.send(_pack(tensors, torch.empty(total, dtype=torch.uint8, device=device), offsets),
                  dst=dist.get_global_rank(group, to), group=group)
        return None
    by_rank = []
    for q in range(size):
        if q == me:
            by_rank.append(tensors)
            continue
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        dist.recv(buf, src=dist.get_global_rank(group, q), group=group)
        by_rank.append(_unpack(buf, offsets, like))
    return [[by_rank[q][i] for q in range(size)] for i in range(len(tensors))]


def per_gpu(backend: str) -> bool:
    """Whether a refit over `backend` is sent per GPU (every sender the whole model, to the engine worker on its
    GPU: `cuda_ipc`) rather than per pipeline stage (each stage's sender its own stage's weights, to every worker)."""
    return backend == "cuda_ipc"


def stage_senders() -> list[int]:
    """The global rank that sends each pipeline stage's weights, by stage: the stage's first rank (its TP, EP and
    data-parallel rank 0, which the stage's gathers reach). Collective over the default group."""
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, ranks().pp_rank)
    return [stages.index(s) for s in range(max(stages) + 1)]


def join_stage_sender(host: str, port: int, world: int, timeout_s: float, backend: str, senders: int,
                      paired: bool | None = None, shard: dict | None = None):
    """Every trainer rank: a stage's sender joins the weight-update group as member `pp_rank` (stage 0's, global
    rank 0, hosts the rendezvous at `host:port`); returns its group, None on the other ranks. `paired` (None:
    `per_gpu(backend)`): the senders are instead global ranks 0 .. senders - 1 of a paired group, rank u serving
    receiver u, the engine worker on its GPU. `shard`: the stage senders' sharded mode (`WeightGroup`; never
    paired). Collective."""
    from ...distributed.weight_group import open_weight_group

    local = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if per_gpu(backend) if paired is None else paired:
        if senders > dist.get_world_size():
            raise RuntimeError(f"weight group ({backend}): {senders} engine workers, {dist.get_world_size()} trainer "
                               "ranks: each engine worker needs the trainer rank on its GPU")
        me = dist.get_rank()
        return open_weight_group(host, port, me, world, timeout_s, backend, local_rank=local, senders=senders,
                                 paired=True) if me < senders else None
    by_stage = stage_senders()
    if len(by_stage) != senders or by_stage[0] != 0:
        raise RuntimeError(f"weight group: {senders} sender(s) expected, the trainer has stages sent by ranks "
                           f"{by_stage} (stage 0's sender must be rank 0, which hosts the rendezvous)")
    me = dist.get_rank()
    if me not in by_stage:
        return None
    return open_weight_group(host, port, by_stage.index(me), world, timeout_s, backend, local_rank=local,
                             senders=senders, shard=shard)


def send_stages(group, stream: Iterator[tuple[str, Tensor]], received: list[int], bucket_bytes: int,
                dtype: torch.dtype | None, key=None) -> dict:
    """Drain `stream` (this rank's stage's tensors, named for the engines) into `group` in `bucket_bytes` buckets
    (None on a rank that does not send, which still takes part in its stage's gathers), `key` the tensor set's
    (a new one resends the headers, `WeightGroup.send`); then every rank's
    figures, on every rank: the senders' bytes and waits, and what each rank received while gathering
    (`received[0]`). Collective."""
    from ...refit import buckets

    if group is not None:
        sent = group.send(buckets(stream, bucket_bytes), dtype, key)
        wait = group.wait_s
    else:
        for _ in stream:
            pass
        sent, wait = 0, 0.0
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, (group is not None, sent, received[0], wait))
    return {"sender_bytes": [b for is_sender, b, _, _ in stats if is_sender],
            "wait_s": [w for is_sender, _, _, w in stats if is_sender],
            "received_bytes": [r for _, _, r, _ in stats]}
