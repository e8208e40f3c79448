"""The 235B projection's train stage, read apart: the pipeline bubble, and what each schedule and MoE dispatcher
choice costs it (`megatron-spec simulate --train-stage`).

The projection's trainer (TP2 PP8 EP16, full recompute, `projection.projection_config`) runs each optimizer step's
micro-batches as one 1F1B schedule call with the alltoall dispatcher. Beside it: one schedule call per micro-batch
(every call fills and drains the pipeline alone, so (pp - 1) of the pp stages idle), interleaved stages (vpp 2),
and the allgather dispatcher (every EP rank receives every token).
"""

from __future__ import annotations

from dataclasses import replace

from .bubble import bubble_factor
from .config import SimConfig
from .pipeline import build
from .stages import _compute_time, _forward_flops, policy_train_time, train_forwards


def variants(cfg: SimConfig) -> list[tuple[str, float, float]]:
    """(label, train-stage seconds of the policy, bubble factor) per variant of `cfg`'s trainer."""
    hw, cal, target, _ = build(cfg)
    m, pp = cfg.packed_micro_batches, cfg.train.pp
    base = policy_train_time(cfg, hw, cal, target)
    compute = _compute_time(cfg, hw, cal, train_forwards(cfg, *_forward_flops(cfg, target,
                                                                               cfg.workload.response.quantiles())))
    one = bubble_factor(m, pp)
    per_micro = bubble_factor(m, pp, calls=m)
    interleaved = replace(cfg, train=replace(cfg.train, vp=2))
    gather = replace(cfg, moe_dispatcher="allgather")
    return [
        ("one schedule call per step, alltoall (the trainer)", base, one),
        ("one schedule call per micro-batch", base + compute * (per_micro / one - 1), per_micro),
        ("interleaved stages, vpp 2", policy_train_time(interleaved, hw, cal, target), bubble_factor(m, pp, 2)),
        ("allgather dispatcher", policy_train_time(gather, hw, cal, target), one),
    ]


def train_stage_report(hardware: str = "h100", gpus: int = 512) -> str:
    from .projection import projection_config

    cfg = projection_config(hardware, gpus)
    t = cfg.train
    lines = [f"Qwen3-235B-A22B train stage on {gpus} {hardware.upper()} (sync, colocated): trainer TP{t.tp} PP{t.pp} "
             f"EP{t.ep} DP{t.dp}, {cfg.packed_micro_batches} micro-batches of {cfg.micro_batch_tokens} tokens per "
             f"DP rank, full recompute",
             f"{'variant':52} {'train s':>9} {'bubble':>7} {'vs trainer':>10}"]
    rows = variants(cfg)
    for label, seconds, bubble in rows:
        lines.append(f"{label:52} {seconds:9.1f} {bubble:7.3f} {seconds / rows[0][1]:10.2f}")
    return "\n".join(lines)
