"""The stages around generation: `data`, `prepare` (refit + wake), `logprob` and `train`, as pure functions.

    data     host time per rollout (batching prompts, scoring rewards)
    prepare  refit bytes (policy + drafter at the rollout dtype) each engine GPU receives, over the link that
             connects trainer and engine, at the refit efficiency; plus the wake-up of a sleeping (colocated) engine
    logprob  2 x active params x tokens + causal attention FLOPs, over the training GPUs at the training MFU, with
             the pipeline bubble and uneven stages, plus tensor/expert-parallel activation traffic; 0 when the
             recompute is folded into the train forward (`SimConfig.fold_logprob`, off by default on a GPU)
    train    3x the logprob FLOPs (forward + backward), the drafter's own 6 x params x tokens when it trains online,
             the same bubble and traffic (3 passes), and the gradient reduce-scatter + all-gather over data
             parallel
"""

from __future__ import annotations

import math

from .calibration import Calibration
from .config import SimConfig
from .hardware import Hardware
from .shapes import CostShape


def data_time(cfg: SimConfig, cal: Calibration) -> float:
    return cfg.workload.rollouts * cal.data_s_per_rollout


def refit_bytes(cfg: SimConfig, target: CostShape, drafter: CostShape | None) -> float:
    """Bytes one engine GPU receives per refit: its 1/tp share of the policy (and drafter) at the rollout dtype."""
    params = target.total_params + (drafter.total_params if drafter is not None else 0.0)
    return params * cfg.gen_dtype_bytes / cfg.gen.tp


def prepare_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
                 drafter: CostShape | None) -> float:
    """Refit over the link plus engine wake-up. Colocated: the trainer's model-parallel group gathers the weights
    and hands them to the engine on the same GPUs (scale-up link, or the NIC if that group spans domains).
    Disaggregated: weights cross the network to engines on other GPUs; the engine never sleeps."""
    nbytes = refit_bytes(cfg, target, drafter)
    if cfg.colocated:
        group = cfg.train.tp * cfg.train.pp * cfg.train.ep
        return nbytes / (hw.collective_bw(max(group, cfg.gen.tp)) * cal.refit_eff) + cal.engine_wake_s
    return nbytes / (hw.collective_bw(cfg.gpus) * cal.refit_eff)


def _forward_flops(cfg: SimConfig, shape: CostShape, lengths: list[float]) -> float:
    """Forward FLOPs of one step's rollouts: linear layers plus causal attention (each token sees half its past)."""
    w = cfg.workload
    mean_len = w.prompt_len + sum(lengths) / len(lengths)
    mean_sq = sum((w.prompt_len + x) ** 2 for x in lengths) / len(lengths)
    per_seq = 2 * shape.active_params * mean_len + shape.attn_flops_per_token_ctx * mean_sq / 2
    return w.rollouts * per_seq


def bubble_factor(cfg: SimConfig) -> float:
    """1F1B pipeline: (m + pp - 1) / m for m micro-batches per data-parallel rank."""
    m = cfg.packed_micro_batches
    return (m + cfg.train.pp - 1) / m


def stage_imbalance(cfg: SimConfig) -> float:
    """Uneven pipeline stages: the stage with ceil(L/pp) layers paces the others (94 layers on pp=8: 12 vs 11.75)."""
    layers = cfg.model_config.num_hidden_layers
    return math.ceil(layers / cfg.train.pp) * cfg.train.pp / layers


def _compute_time(cfg: SimConfig, hw: Hardware, cal: Calibration, flops: float) -> float:
    ideal = flops / (cfg.train_gpus * hw.flops(2) * cal.train_mfu)
    return ideal * bubble_factor(cfg) * stage_imbalance(cfg)


def model_parallel_comm_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
                             passes: int) -> float:
    """Activation traffic the MFU does not cover: 2 TP all-reduces per layer and pass over the tokens of one
    data-parallel rank (a pass = forward, or each half of backward), and 2 EP all-to-alls per MoE layer and pass.
    Counted as exposed: overlapping them with compute is what a good MFU already assumes for the rest."""
    t, w = cfg.train, cfg.workload
    tokens = w.rollouts * w.tokens_per_rollout / (t.dp * t.cp)  # tokens one rank's activations cover
    total = 0.0
    if t.tp > 1:
        buf = tokens * target.hidden * 2 / t.tp  # sequence parallel: each rank holds 1/tp of the tokens
        total += 2 * target.layers * passes * 2 * (t.tp - 1) * buf / (hw.collective_bw(t.tp) * cal.link_eff)
    if t.ep > 1 and target.moe_layers:
        buf = tokens / t.tp * target.top_k * target.hidden * 2 * (t.ep - 1) / t.ep
        total += 2 * target.moe_layers * passes * buf / (hw.collective_bw(t.ep * t.tp) * cal.link_eff)
    return total / t.pp  # each stage holds 1/pp of the layers; stages work in parallel


def logprob_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape) -> float:
    """The recompute forward; 0 when it is folded into the train forward (`cfg.fold_logprob`: only host
    bookkeeping is left, which the GPU model does not describe)."""
    if cfg.fold_logprob:
        return 0.0
    flops = _forward_flops(cfg, target, cfg.workload.response.quantiles())
    return _compute_time(cfg, hw, cal, flops) + model_parallel_comm_time(cfg, hw, cal, target, passes=1)


def grad_sync_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape) -> float:
    """Reduce-scatter + all-gather of BF16 gradients over data parallel (2 (dp-1)/dp of the local bytes); the
    replicas of one model sit `tp*pp*cp` GPUs apart, so the group leaves the NVLink domain with them."""
    t = cfg.train
    if t.dp * t.cp == 1:
        return 0.0
    expert_total = target.moe_layers * target.experts * target.expert_params
    local = (target.total_params - expert_total) / (t.tp * t.pp) + expert_total / (t.ep * t.pp)
    n = t.dp * t.cp
    span = t.tp * t.pp * t.cp * t.dp
    return 2 * (n - 1) / n * local * 2 / (hw.collective_bw(span) * cal.link_eff) + 2 * cal.collective_latency_s


def train_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
               drafter: CostShape | None) -> float:
    lengths = cfg.workload.response.quantiles()
    flops = 3 * _forward_flops(cfg, target, lengths)
    if cfg.spec is not None and cfg.spec.online_drafter_training and drafter is not None:
        flops += 3 * _forward_flops(cfg, drafter, lengths)
    comm = model_parallel_comm_time(cfg, hw, cal, target, passes=3)
    return _compute_time(cfg, hw, cal, flops) + comm + grad_sync_time(cfg, hw, cal, target)
