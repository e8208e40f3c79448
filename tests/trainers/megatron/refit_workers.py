"""What each of the 2 gloo ranks runs for `test_refit_stream.py`: the refit stream against the export the refit
used before (checkpoint-sized buckets, cast by the weight group after gathering), and the sending rank's peak of
live tensor bytes (`tests/live_bytes.py`) while it streams a model many buckets large into a one-rank
weight-update group (no receivers, so the measured process is the sender alone)."""

from __future__ import annotations

import torch

from .common import hf_tensors, tiny

LAYOUTS = [("dense", dict(tp=2)), ("moe", dict(ep=2, etp=1)), ("moe", dict(pp=2))]
SMALL_BUCKET = 80 * 1024
"""Above the largest parameter of the tiny models in bf16, small enough for many buckets."""
BIG = dict(vocab_size=2048, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
           head_dim=64, intermediate_size=2048)
"""A dense model of 33.6 M parameters (134 MB fp32, 67 MB bf16) whose largest parameter is 4 MiB in bf16."""
BIG_BUCKET = 4 << 20


def run_all(rank: int, world: int) -> dict:
    from megatron_spec.trainers.megatron.parallel import Parallelism

    out = {}
    for kind, sizes in LAYOUTS:
        out[kind, tuple(sorted(sizes.items()))] = _identity(tiny(kind), Parallelism(**sizes))
    out["memory"] = _memory(rank, Parallelism(tp=2))
    return out


def _model(cfg, par, mtp_layers):
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    init_model_parallel(par, cfg)
    model = build_model(cfg, par, mtp_num_layers=mtp_layers, init=False)
    hf = hf_tensors(cfg, mtp_layers=mtp_layers)
    import_hf(model, hf)
    return model


def _identity(cfg, par) -> dict:
    from megatron_spec.trainers.megatron.exporter import export_hf
    from megatron_spec.trainers.megatron.refit_stream import refit_buckets

    model = _model(cfg, par, mtp_layers=2)
    before = {n: t.to(torch.bfloat16) for n, t in export_hf(model)}  # gathered in fp32, cast by the sender
    buckets = [[(n, t.clone()) for n, t in b] for b in refit_buckets(model, SMALL_BUCKET, torch.bfloat16)]
    fp32 = {n: t.clone() for b in refit_buckets(model, SMALL_BUCKET) for n, t in b}
    return {"before": before, "before_fp32": {n: t.clone() for n, t in export_hf(model)},
            "streamed": {n: t for b in buckets for n, t in b}, "streamed_fp32": fp32,
            "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]}


def _memory(rank: int, par) -> dict:
    """Live tensor bytes at their peak (`tests/live_bytes.py`: counted by torch's CPU allocator, so nothing the
    process did before counts; gloo lets go of each broadcast's tensors before the caller goes on, so every free
    is counted), for a refit of the big model through the refit stream (re-bucketed, as the trainer sends it) and
    then through the export the refit used before. Both ranks gather; rank 0 also sends."""
    from megatron_spec.trainers.megatron.exporter import export_hf
    from megatron_spec.trainers.megatron.refit_stream import refit_buckets
    from megatron_spec.distributed.process_groups import free_port
    from megatron_spec.distributed.weight_group import open_weight_group
    from megatron_spec.refit import buckets

    from ...live_bytes import gloo_lets_go, live_bytes

    model = _model(tiny("dense", **BIG), par, mtp_layers=0)

    def measure(stream, group) -> dict:
        with gloo_lets_go(*[g for g in [group] if g is not None]), live_bytes() as counted:
            if group is not None:
                sent = group.send(stream, torch.bfloat16)
            else:
                sent = sum(t.numel() * 2 for b in stream for _, t in b)
        kept = sum(b.numel() for b in group._buffers) if group is not None else 0
        return {"peak": counted.peak, "end": counted.end, "allocated": counted.allocated, "bytes": sent,
                "payload_buffers": kept}

    def pairs(stream):  # what the policy's export_weights yields, and the trainer's refit buckets again
        return buckets((item for bucket in stream for item in bucket), BIG_BUCKET)

    def group():
        return open_weight_group("127.0.0.1", free_port(), 0, 1, 60, "gloo") if rank == 0 else None

    refit = group()
    streamed = measure(pairs(refit_buckets(model, BIG_BUCKET, torch.bfloat16)), refit)  # the first: FRAMED
    packed = measure(pairs(refit_buckets(model, BIG_BUCKET, torch.bfloat16)), refit)  # later ones: PACKED
    before = measure(buckets(export_hf(model), BIG_BUCKET), group())
    return {"streamed": streamed, "packed": packed, "before": before}
