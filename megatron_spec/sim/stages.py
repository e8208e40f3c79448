"""The stages around generation: `data`, `prepare` (refit + wake), `logprob` and `train`, as pure functions.

    data     host time per rollout (batching prompts, scoring rewards)
    prepare  refit bytes (policy + drafter at the rollout dtype) each engine GPU receives, over the placement's
             transport (`refit_link`: CUDA IPC or an NVLink gather colocated, an NVLink or InfiniBand broadcast
             disaggregated, a measured gloo figure on the CPU host); colocated, also the wake-up of the sleeping
             engine and the host round trip of the trainer's states and the engine's weights (`SimConfig.offload`)
    logprob  2 x active params x tokens + causal attention FLOPs, over the training GPUs at the training MFU of the
             model's kind, with the pipeline bubble and uneven stages, plus tensor/expert-parallel activation
             traffic; a second pass (and a host swap of its weights) for the reference policy when
             `SimConfig.reference_logprob`; 0 when the recompute is folded into the train forward
    train    3 forwards' FLOPs (forward + backward), 4 with full recomputation and 3 plus the attention core with
             selective; the same bubble and traffic per optimizer step, and the gradient reduce-scatter +
             all-gather over data parallel once per optimizer step; plus, when it trains online, the drafter's
             passes at its own size and its optimizer steps (`drafter_train_time`)
"""

from __future__ import annotations

import math

from .bubble import bubble_factor as pipeline_bubble
from .calibration import Calibration
from .config import SimConfig
from .hardware import Hardware
from .memory import MemoryReport, memory_report
from .shapes import CostShape, drafter_shape, shape_of


def _memory(cfg: SimConfig, hw: Hardware) -> MemoryReport:
    """The memory report of `cfg`, for callers that did not pass one (the tuner ranks training sides with it)."""
    kv_bytes = 4 if cfg.gen_dtype_bytes == 4 else 2
    target = shape_of(cfg.model_config, kv_dtype_bytes=kv_bytes)
    s = cfg.spec
    drafter = None if s is None else drafter_shape(cfg.model_config, s.drafter, s.draft_model, s.drafter_layers,
                                                   s.draft_vocab, kv_bytes)
    return memory_report(cfg, hw, target, drafter)


def data_time(cfg: SimConfig, cal: Calibration) -> float:
    return cfg.workload.rollouts * cal.data_s_per_rollout


def refit_bytes(cfg: SimConfig, target: CostShape, drafter: CostShape | None) -> float:
    """Bytes one engine GPU receives per refit: its 1/tp share of the policy (and drafter) at the rollout dtype."""
    params = target.total_params + (drafter.total_params if drafter is not None else 0.0)
    return params * cfg.gen_dtype_bytes / cfg.gen.tp


def offload_time(cfg: SimConfig, hw: Hardware, cal: Calibration, mem: MemoryReport | None) -> float:
    """Colocated with `cfg.offload`: the trainer's weights, gradients and optimizer states leave the GPU before
    generation and return after it, and the engine's weights do the reverse (sleep and wake): every one of those
    bytes crosses the host link twice a step."""
    if not cfg.offloads:
        return 0.0
    mem = mem or _memory(cfg, hw)
    nbytes = 2 * (mem.train_weights + mem.train_optimizer + mem.engine_weights)
    return nbytes / (hw.host_bw * cal.offload_eff)


def refit_link(cfg: SimConfig, hw: Hardware, cal: Calibration) -> tuple[str, float]:
    """(transport, bytes/s it reaches) of the weight refit.

    - A profile with a measured refit figure (`Hardware.refit_bw`, the CPU host's gloo broadcast) uses it as
      measured, whatever the placement.
    - Colocated, trainer and engine on the same GPUs: each engine GPU reads the trainer's tensors through CUDA IPC
      handles, a device copy that reads and writes every byte (half the HBM bandwidth at `mem_eff`), when neither
      side is split across GPUs; otherwise the trainer's model-parallel group gathers each bucket to the engine's
      layout over the scale-up link (the NIC if the group spans domains) at `refit_eff`.
    - Disaggregated: the owning ranks broadcast over a weight-update group to engines on other GPUs, over NVLink
      while the job fits one scale-up domain and over the network (InfiniBand) beyond it, at `refit_eff`."""
    if hw.refit_bw:
        return "gloo broadcast (measured)", hw.refit_bw
    if cfg.colocated:
        group = max(cfg.train.tp * cfg.train.pp * cfg.train.ep, cfg.gen.tp)
        if group == 1:
            return "CUDA IPC device copy (spec sheet)", hw.mem_bw / 2 * cal.mem_eff
        link = "NVLink" if group <= hw.domain_size else "network"
        return f"{link} gather + CUDA IPC (spec sheet)", hw.collective_bw(group) * cal.refit_eff
    link = "NVLink" if cfg.gpus <= hw.domain_size else "InfiniBand"
    return f"{link} broadcast (spec sheet)", hw.collective_bw(cfg.gpus) * cal.refit_eff


def refit_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape, drafter: CostShape | None) -> float:
    """Seconds to move one refit's bytes (`refit_bytes`) over `refit_link`."""
    return refit_bytes(cfg, target, drafter) / refit_link(cfg, hw, cal)[1]


def prepare_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
                 drafter: CostShape | None, mem: MemoryReport | None = None) -> float:
    """Refit (`refit_time`) plus, colocated, the wake-up of the sleeping engine and the host round trip of
    `offload_time`; a disaggregated engine never sleeps."""
    refit = refit_time(cfg, hw, cal, target, drafter)
    if cfg.colocated:
        return refit + cal.engine_wake_s + offload_time(cfg, hw, cal, mem)
    return refit


def _forward_flops(cfg: SimConfig, shape: CostShape, lengths: list[float]) -> tuple[float, float]:
    """Forward FLOPs of one step's rollouts as (linear layers, causal attention: each token sees half its past)."""
    w = cfg.workload
    mean_len = w.prompt_len + sum(lengths) / len(lengths)
    mean_sq = sum((w.prompt_len + x) ** 2 for x in lengths) / len(lengths)
    return w.rollouts * 2 * shape.active_params * mean_len, w.rollouts * shape.attn_flops_per_token_ctx * mean_sq / 2


def bubble_factor(cfg: SimConfig) -> float:
    """The pipeline's fill and drain (`bubble.bubble_factor`): (m + (pp - 1) / vpp) / m for m micro-batches per
    data-parallel rank and optimizer step, all in one schedule call (each optimizer step fills and drains)."""
    return pipeline_bubble(cfg.packed_micro_batches, cfg.train.pp, cfg.train.vp)


def stage_imbalance(cfg: SimConfig) -> float:
    """Uneven pipeline stages: the stage with ceil(L/pp) layers paces the others (94 layers on pp=8: 12 vs 11.75)."""
    layers = cfg.model_config.num_hidden_layers
    return math.ceil(layers / cfg.train.pp) * cfg.train.pp / layers


def train_peak(cfg: SimConfig, hw: Hardware, cal: Calibration) -> float:
    """FLOP/s one training GPU sustains: the BF16 peak (or the FP8 gain on it) times the MFU of the model's kind."""
    peak = hw.flops_bf16 * (1 + (hw.fp8_speedup - 1) * cal.fp8_train_gain if cfg.train_fp8 else 1.0)
    return peak * cal.mfu(cfg.model_config.is_moe)


def _compute_time(cfg: SimConfig, hw: Hardware, cal: Calibration, flops: float) -> float:
    ideal = flops / (cfg.train_gpus * train_peak(cfg, hw, cal))
    return ideal * bubble_factor(cfg) * stage_imbalance(cfg)


def model_parallel_comm_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
                             passes: int) -> float:
    """Activation traffic the MFU does not cover: 2 TP all-reduces per layer and pass over the tokens of one
    data-parallel rank (a pass = forward, or each half of backward), and 2 EP all-to-alls per MoE layer and pass.
    Counted as exposed: overlapping them with compute is what a good MFU already assumes for the rest. The
    alltoall dispatcher sends each token's top-k copies to other EP ranks; allgather gives every EP rank all
    tokens (and reduce-scatters them back), ep / top_k times the bytes (`SimConfig.moe_dispatcher`)."""
    t, w = cfg.train, cfg.workload
    tokens = w.rollouts * w.tokens_per_rollout / (t.dp * t.cp)  # tokens one rank's activations cover
    total = 0.0
    if t.tp > 1:
        buf = tokens * target.hidden * 2 / t.tp  # sequence parallel: each rank holds 1/tp of the tokens
        total += 2 * target.layers * passes * 2 * (t.tp - 1) * buf / (hw.collective_bw(t.tp) * cal.link_eff)
    if t.ep > 1 and target.moe_layers:
        copies = target.top_k * (t.ep - 1) / t.ep if cfg.moe_dispatcher == "alltoall" else t.ep - 1
        buf = tokens / t.tp * copies * target.hidden * 2
        total += 2 * target.moe_layers * passes * buf / (hw.collective_bw(t.ep * t.tp) * cal.link_eff)
    return total / t.pp  # each stage holds 1/pp of the layers; stages work in parallel


def reference_swap_time(cfg: SimConfig, hw: Hardware, cal: Calibration, mem: MemoryReport | None) -> float:
    """The reference policy's BF16 weights come in from host memory for its pass and the policy's go back: the
    local weights (a third of `train_weights`, which counts 2 B of weights and 4 B of gradients) twice."""
    if not cfg.reference_logprob:
        return 0.0
    mem = mem or _memory(cfg, hw)
    return 2 * mem.train_weights / 3 / (hw.host_bw * cal.offload_eff)


def logprob_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
                 mem: MemoryReport | None = None) -> float:
    """The recompute forward (and the reference policy's, `cfg.reference_logprob`); 0 when the recompute is
    folded into the train forward and no reference runs (`cfg.fold_logprob`: only host bookkeeping is left,
    which the GPU model does not describe)."""
    passes = (0 if cfg.fold_logprob else 1) + (1 if cfg.reference_logprob else 0)
    if not passes:
        return 0.0
    flops = sum(_forward_flops(cfg, target, cfg.workload.response.quantiles()))
    one = _compute_time(cfg, hw, cal, flops) + model_parallel_comm_time(cfg, hw, cal, target, passes=1)
    return passes * one + reference_swap_time(cfg, hw, cal, mem)


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


def train_forwards(cfg: SimConfig, linear: float, attention: float) -> float:
    """FLOPs of forward + backward with recomputation: backward is 2 forwards; 'full' reruns the forward,
    'selective' the attention core only."""
    one = linear + attention
    extra = {"none": 0.0, "selective": attention, "full": one}[cfg.recompute]
    return 3 * one + extra


ADAM_BYTES_PER_PARAM = 28
"""FP32 AdamW touches per parameter and step: reads weight, gradient and both moments (16 B), writes weight and
moments (12 B)."""


def drafter_train_time(cfg: SimConfig, hw: Hardware, cal: Calibration, drafter: CostShape | None) -> float:
    """The online drafter's training per RL step, 0 when it does not train online: `drafter_passes` forward +
    backward passes (3 forwards' FLOPs each) of the drafter over the step's tokens at the drafter's own size, at the
    trainer's rate, and `drafter_optimizer_steps` AdamW steps over its parameters at the memory bandwidth, each
    one training call paying `Calibration.train_call_s` on a host that dispatches eagerly. It learns on the
    policy's detached states, so no trunk pass is added; its gradient never reaches the trunk."""
    s = cfg.spec
    if s is None or not s.online_drafter_training or drafter is None:
        return 0.0
    flops = s.drafter_passes * 3 * sum(_forward_flops(cfg, drafter, cfg.workload.response.quantiles()))
    adam = ADAM_BYTES_PER_PARAM * drafter.total_params / (hw.mem_bw * cal.mem_eff) + cal.train_call_s
    return _compute_time(cfg, hw, cal, flops) + s.drafter_optimizer_steps * adam


def policy_train_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape) -> float:
    """The policy's forward + backward over the step's rollouts, its activation traffic and gradient sync."""
    flops = train_forwards(cfg, *_forward_flops(cfg, target, cfg.workload.response.quantiles()))
    passes = 4 if cfg.recompute == "full" else 3
    comm = model_parallel_comm_time(cfg, hw, cal, target, passes=passes)
    return _compute_time(cfg, hw, cal, flops) + comm + cfg.optimizer_steps * grad_sync_time(cfg, hw, cal, target)


def train_time(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape,
               drafter: CostShape | None) -> float:
    """The `train` stage: the policy's training and, when it trains online, the drafter's."""
    return policy_train_time(cfg, hw, cal, target) + drafter_train_time(cfg, hw, cal, drafter)


def refit_table(model: str, fp8: bool = False) -> str:
    """Seconds for one engine GPU to receive a whole copy of `model` over each transport the step model knows, with
    where each figure comes from: the CPU host's measured gloo broadcast (float32, as that host serves), and, on
    H100, the colocated CUDA IPC device copy, the NVLink gather and the InfiniBand broadcast (spec sheets, at the
    calibration's efficiencies), with the one CUDA IPC refit measured on an H100 beside them."""
    from .calibration import calibration_for
    from .config import resolve_model
    from .hardware import H100_CUDA_IPC_MEASURED_BW, NDR_IB_BW, NVLINK4_BW, hardware
    from .shapes import shape_of

    params = shape_of(resolve_model(model)).total_params
    cpu, h100 = hardware("cpu"), hardware("h100")
    cal = calibration_for("h100")
    served = 1 if fp8 else 2
    rows = [("CPU host: gloo broadcast", "measured, 0.537 GB/s", 4, cpu.refit_bw),
            ("H100 colocated: CUDA IPC device copy", "spec: HBM3 3.35 TB/s, read + write, x mem_eff",
             served, h100.mem_bw / 2 * cal.mem_eff),
            ("H100 colocated: CUDA IPC, 2 GiB", "measured once, handles and sync included", served,
             H100_CUDA_IPC_MEASURED_BW),
            ("H100 NVLink 4 gather / broadcast", "spec: 900 GB/s both ways per GPU, x refit_eff", served,
             NVLINK4_BW / 2 * cal.refit_eff),
            ("InfiniBand NDR broadcast", "spec: 400 Gb/s per port, x refit_eff", served, NDR_IB_BW * cal.refit_eff)]
    lines = [f"refit of {model} ({params / 1e9:.2f} B parameters), one whole copy per receiving engine GPU (divide "
             "by the engine's TP for its share)",
             f"{'transport':38} {'figure':48} {'GB':>8} {'GB/s':>8} {'seconds':>9}"]
    for name, source, dtype_bytes, bw in rows:
        nbytes = params * dtype_bytes
        lines.append(f"{name:38} {source:48} {nbytes / 1e9:8.2f} {bw / 1e9:8.2f} {nbytes / bw:9.3f}")
    return "\n".join(lines)
