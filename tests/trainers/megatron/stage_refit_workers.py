"""What each of the 4 gloo ranks (PP2 x EP2) runs for `test_stage_refit.py`: each pipeline stage's first rank
sends its own stage's buckets into a weight-update group whose one receiver runs in a thread of rank 0's process
(a member of its own, as an engine worker would be), for two refits (the first FRAMED, the second PACKED); then
each rank's own stage stream and the whole-model stream of the per-GPU refit, with the bytes each brought it."""

from __future__ import annotations

import threading

import torch

from .common import tiny
from .refit_workers import SMALL_BUCKET, _model


def run(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.exporter import export_hf
    from megatron_spec.trainers.megatron.parallel import Parallelism, ranks
    from megatron_spec.trainers.megatron.refit_stream import (join_stage_sender, refit_buckets, send_stages,
                                                              stage_buckets)
    from megatron_spec.distributed.process_groups import free_port
    from megatron_spec.distributed.weight_group import open_weight_group

    model = _model(tiny("moe"), Parallelism(pp=2, ep=2, etp=1), mtp_layers=2)
    whole = {n: t.to(torch.bfloat16) for n, t in export_hf(model)}
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    senders, members = 2, 3
    got, box = [], {}

    def receiver():
        try:
            member = open_weight_group("127.0.0.1", port[0], senders, members, 120, "gloo", senders=senders)
            for _ in range(2):
                got.append({n: t.clone() for b in member.receive() for n, t in b})
            box["received"] = member.received
        except BaseException as err:  # reported, not lost in the thread
            box["error"] = repr(err)

    thread = threading.Thread(target=receiver) if rank == 0 else None
    if thread is not None:
        thread.start()
    group = join_stage_sender("127.0.0.1", port[0], members, 120, "gloo", senders)
    stats = []
    for _ in range(2):
        received = [0]
        stream = (item for b in stage_buckets(model, SMALL_BUCKET, torch.bfloat16, received) for item in b)
        stats.append(send_stages(group, stream, received, SMALL_BUCKET, torch.bfloat16))
    if thread is not None:
        thread.join(120)
    r = ranks()
    own = {n for b in stage_buckets(model, SMALL_BUCKET, torch.bfloat16) for n, _ in b}
    # The per-GPU (CUDA IPC) stream: every rank walks the whole model; what it received, what it yielded.
    whole_received = [0]
    walked = sum(t.numel() * t.element_size() for b in refit_buckets(model, SMALL_BUCKET, torch.bfloat16,
                                                                       whole_received) for _, t in b)
    # The experts this rank does not hold: every expert tensor of its stage less its own EP rank's (bf16).
    mine = {n for n, p in model.named_parameters() if ".experts." in n}
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if n in mine) * (r.ep - 1)
    return {"pp_rank": r.pp_rank, "sender": group is not None, "stats": stats, "whole": whole, "own": sorted(own),
            "others_experts": experts, "got": got, "whole_received": whole_received[0], "walked": walked,
            **box}


def run_paired(rank: int, world: int) -> dict:
    """The per-GPU refit's shape on gloo: every rank sends the whole model (`refit_buckets`) into a paired group,
    rank u to receiver u (a thread of rank u's process, as the engine worker on its GPU would be), for two refits
    (FRAMED, then PACKED). Returns what this rank's receiver got and the refits' figures."""
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.exporter import export_hf
    from megatron_spec.trainers.megatron.parallel import Parallelism
    from megatron_spec.trainers.megatron.refit_stream import join_stage_sender, refit_buckets, send_stages
    from megatron_spec.distributed.process_groups import free_port
    from megatron_spec.distributed.weight_group import open_weight_group

    model = _model(tiny("moe"), Parallelism(pp=2, ep=2, etp=1), mtp_layers=2)
    whole = {n: t.to(torch.bfloat16) for n, t in export_hf(model)}
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    got, box = [], {}

    def receiver():
        try:
            member = open_weight_group("127.0.0.1", port[0], world + rank, 2 * world, 120, "gloo", senders=world,
                                       paired=True)
            for _ in range(2):
                got.append({n: t.clone() for b in member.receive() for n, t in b})
            box["received"], box["groups"] = member.received, len(member.pgs)
        except BaseException as err:  # reported, not lost in the thread
            box["error"] = repr(err)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = join_stage_sender("127.0.0.1", port[0], 2 * world, 120, "gloo", world, paired=True)
    stats = []
    for _ in range(2):
        received = [0]
        stream = (item for b in refit_buckets(model, SMALL_BUCKET, torch.bfloat16, received) for item in b)
        stats.append(send_stages(group, stream, received, SMALL_BUCKET, torch.bfloat16))
    thread.join(120)
    return {"whole": whole, "got": got, "stats": stats, "paired": group.paired, **box}
