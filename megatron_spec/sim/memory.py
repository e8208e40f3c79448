"""Memory fit per GPU: the trainer's weights, gradients, optimizer states and activations; the engine's weights,
drafter, workspace and KV cache.

Trainer (Megatron-style, BF16 weights, FP32 gradient buffers, distributed Adam):
    weights 2 B + gradients 4 B per local parameter, FP32 master weights and the two Adam moments (12 B) sharded
    over the data-parallel replicas; activations with per-layer recomputation: each layer's input (2 B per token
    per hidden unit) for the micro-batches 1F1B keeps in flight, one layer's live activations (~34 B per token per
    hidden unit, Korthikanti et al. 2022; every layer's with `recompute='none'`) and the float32 logits of one
    micro-batch.
Engine (vLLM-style): weights and drafter at the rollout dtype, a fixed workspace plus the sampler's float32 logits
    for a full batch of verify tokens; the KV cache gets what is left of `gpu_memory_utilization` of the device.

Colocated placements time-share the GPUs (the engine sleeps during training and the trainer's states are offloaded
during generation, as NeMo-RL does), so each side must fit on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import SimConfig
from .hardware import Hardware
from .shapes import CostShape

GiB = 2 ** 30
ENGINE_WORKSPACE_BYTES = 2 * GiB  # CUDA context, captured graphs, activation scratch
LAYER_ACT_BYTES_PER_TOKEN_HIDDEN = 34  # live activations of one transformer layer (Korthikanti et al. 2022)


@dataclass(frozen=True)
class MemoryReport:
    train_weights: float
    """Trainer bytes per GPU for BF16 weights and FP32 gradients."""
    train_optimizer: float
    """Trainer bytes per GPU for master weights and Adam moments (sharded over data parallel)."""
    train_activations: float
    """Trainer bytes per GPU for activations of the in-flight micro-batches."""
    engine_weights: float
    """Engine bytes per GPU for the policy and drafter weights."""
    engine_workspace: float
    """Engine bytes per GPU for workspace and sampler logits."""
    kv_bytes: float
    """Engine bytes per GPU left for the KV cache."""
    kv_capacity_tokens: float
    """Context tokens one engine's KV cache holds (all its GPUs together)."""
    device_bytes: float
    """Memory of one device."""

    @property
    def train_total(self) -> float:
        return self.train_weights + self.train_optimizer + self.train_activations


def kv_bytes_per_token_per_gpu(shape: CostShape, tp: int) -> float:
    """KV heads split over at most `kv_heads` ranks (replicated beyond), so one GPU holds ceil(kv/tp) of them."""
    return shape.kv_bytes_per_token * math.ceil(shape.kv_heads / tp) / shape.kv_heads


def memory_report(cfg: SimConfig, hw: Hardware, target: CostShape, drafter: CostShape | None) -> MemoryReport:
    """Per-GPU memory of the trainer and of one engine for this configuration."""
    t, m = cfg.train, cfg.workload
    expert_total = target.moe_layers * target.experts * target.expert_params
    stage = math.ceil(target.layers / t.pp) / target.layers  # share of the layers on the fullest stage
    local = (target.total_params - expert_total) / t.tp * stage + expert_total / t.ep * stage
    if cfg.spec is not None and cfg.spec.online_drafter_training and drafter is not None:
        local += drafter.total_params  # the drafter trains replicated on every rank (it is small)
    weights = local * (2 + 4)
    optimizer = local * 12 / (t.dp * t.cp)
    rank_tokens = m.rollouts * m.tokens_per_rollout / t.dp
    mb_tokens = min(cfg.micro_batch_tokens or rank_tokens, rank_tokens) / t.cp
    in_flight = min(t.pp, cfg.packed_micro_batches)
    layers_per_stage = math.ceil(target.layers / t.pp)
    act = mb_tokens * target.hidden * 2 * layers_per_stage * in_flight / t.tp
    live_layers = layers_per_stage * in_flight if cfg.recompute == "none" else 1  # without recompute all are kept
    act += mb_tokens * target.hidden * LAYER_ACT_BYTES_PER_TOKEN_HIDDEN * live_layers / t.tp
    act += mb_tokens * target.vocab * 4 / t.tp

    g = cfg.gen.tp
    eng_weights = target.total_params * cfg.gen_dtype_bytes / g
    kv_per_token = kv_bytes_per_token_per_gpu(target, g)
    if drafter is not None:
        eng_weights += drafter.total_params * cfg.gen_dtype_bytes / g
        kv_per_token += kv_bytes_per_token_per_gpu(drafter, g)
    verify_tokens = cfg.max_num_seqs * ((cfg.spec.k + 1) if cfg.spec else 1)
    workspace = ENGINE_WORKSPACE_BYTES + verify_tokens * target.vocab * 4
    kv = hw.mem_bytes * cfg.gpu_memory_utilization - eng_weights - workspace
    return MemoryReport(
        train_weights=weights, train_optimizer=optimizer, train_activations=act, engine_weights=eng_weights,
        engine_workspace=workspace, kv_bytes=kv, kv_capacity_tokens=max(kv, 0.0) / kv_per_token,
        device_bytes=hw.mem_bytes,
    )


def with_params_dtype(report: MemoryReport, params_dtype: str) -> MemoryReport:
    """The trainer's memory for parameters of `params_dtype`: float32 parameters take 4 B of weights and 4 B of
    gradients (8 B instead of 6) and the optimizer the two Adam moments only, no separate FP32 master (8 B instead
    of 12); bfloat16 is what `memory_report` describes."""
    if params_dtype in ("bfloat16", "bf16"):
        return report
    if params_dtype not in ("float32", "fp32"):
        raise ValueError(f"params_dtype must be float32 or bfloat16, got {params_dtype!r}")
    return replace(report, train_weights=report.train_weights * 8 / 6, train_optimizer=report.train_optimizer * 8 / 12)


def check_fit(cfg: SimConfig, report: MemoryReport) -> None:
    """Raise a ValueError naming the side and the constraint that does not fit."""
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    if report.train_total > report.device_bytes:
        raise ValueError(
            f"trainer does not fit in memory: {gib(report.train_total)} per GPU (weights+grads "
            f"{gib(report.train_weights)}, optimizer {gib(report.train_optimizer)}, activations "
            f"{gib(report.train_activations)}) > {gib(report.device_bytes)}; raise tp/pp/ep or dp, or lower "
            "micro_batch_tokens")
    need = cfg.workload.prompt_len + cfg.workload.response.max_tokens
    if report.kv_capacity_tokens < need:
        raise ValueError(
            f"generation engine does not fit in memory: weights {gib(report.engine_weights)} + workspace "
            f"{gib(report.engine_workspace)} per GPU leave room for {report.kv_capacity_tokens:.0f} KV tokens, "
            f"fewer than one {need}-token sequence; raise gen tp or gpu_memory_utilization, or use FP8")


def fits(cfg: SimConfig, report: MemoryReport) -> bool:
    try:
        check_fit(cfg, report)
    except ValueError:
        return False
    return True
