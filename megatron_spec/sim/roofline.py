"""Time of one forward pass of one inference engine: a roofline per kernel family plus collectives and overhead.

    linear    max(weight bytes / BW, 2 * active params * tokens / FLOPs)     weights read once for the whole batch
    attention max(KV bytes / BW,     attention FLOPs / FLOPs)                 KV read once per sequence, shared by
                                                                              its k+1 verify queries
    sampler   tokens * vocab * 4 bytes * 2 / BW                               write + read the float32 logits
    comm      2 all-reduces per layer over TP, 2 all-to-alls per MoE layer over EP
    overhead  a fixed cost per forward (`Calibration.forward_overhead_s`)

The compute families' sum (linear, attention, sampler) is divided by `Calibration.decode_eff`, the share of this
roofline a serving engine reaches over a whole generation (1 on the Blackwell set, fitted on Hopper); collectives
keep their own link efficiency.

Each family is its own roofline (they run as separate kernels, one after the other), so the sum of maxima is used
rather than one max over the whole pass. All figures are per GPU of a `tp`-wide engine: weights, KV heads and
FLOPs split `tp` ways. MoE expert bytes count only the experts the batch touches (`CostShape.experts_touched`).
"""

from __future__ import annotations

import math

from .calibration import Calibration
from .hardware import Hardware
from .shapes import CostShape

ACT_BYTES = 2  # activations move between GPUs in BF16
LOGIT_BYTES = 4  # samplers work on float32 logits


def linear_time(shape: CostShape, hw: Hardware, cal: Calibration, tokens: float, tp: int, dtype_bytes: float) -> float:
    """Dense + expert GEMMs of one forward over `tokens` tokens."""
    expert_bytes = shape.moe_layers * shape.experts_touched(tokens) * shape.expert_params
    weight_bytes = (shape.dense_params + expert_bytes) * dtype_bytes / tp
    flops = 2.0 * shape.active_params * tokens / tp
    return max(weight_bytes / (hw.mem_bw * cal.mem_eff), flops / (hw.flops(dtype_bytes) * cal.gemm_eff))


def attention_time(shape: CostShape, hw: Hardware, cal: Calibration, q_tokens: float, ctx_tokens: float,
                   tp: int, dtype_bytes: float) -> float:
    """Attention of `q_tokens` query tokens per sequence over `ctx_tokens` context tokens summed over sequences.

    KV heads split over at most `kv_heads` ranks; past that they are replicated, so a rank holds ceil(kv/tp)."""
    kv_share = math.ceil(shape.kv_heads / tp) / shape.kv_heads
    kv_bytes = ctx_tokens * shape.kv_bytes_per_token * kv_share
    flops = shape.attn_flops_per_token_ctx * q_tokens * ctx_tokens / tp
    attn_flops = hw.flops(max(dtype_bytes, 2))  # attention stays in BF16 even with FP8 weights
    return max(kv_bytes / (hw.mem_bw * cal.mem_eff), flops / (attn_flops * cal.gemm_eff))


def sampler_time(shape: CostShape, hw: Hardware, cal: Calibration, tokens: float) -> float:
    """The sampler writes and reads the float32 logits of every new token."""
    return tokens * shape.vocab * LOGIT_BYTES * 2 / (hw.mem_bw * cal.mem_eff)


def collective_time(hw: Hardware, cal: Calibration, shape: CostShape, tokens: float, tp: int, ep: int) -> float:
    """Tensor-parallel all-reduces (ring: 2 (tp-1)/tp of the buffer per rank) and expert all-to-alls."""
    total = 0.0
    if tp > 1:
        buf = tokens * shape.hidden * ACT_BYTES
        per_call = cal.latency(hw, tp) + 2 * (tp - 1) / tp * buf / (hw.collective_bw(tp) * cal.link_eff)
        total += 2 * shape.layers * per_call
    if ep > 1 and shape.moe_layers:
        buf = tokens * shape.top_k * shape.hidden * ACT_BYTES * (ep - 1) / ep / tp
        per_call = cal.latency(hw, ep) + buf / (hw.collective_bw(ep) * cal.link_eff)
        total += 2 * shape.moe_layers * per_call
    return total


def forward_time(shape: CostShape, hw: Hardware, cal: Calibration, n_seqs: float, q_tokens: float,
                 ctx_tokens: float, tp: int = 1, ep: int = 1, dtype_bytes: float = 2,
                 sample: bool = True) -> float:
    """Seconds for one forward of `n_seqs` sequences with `q_tokens` new tokens each over `ctx_tokens` total
    context; `sample` adds the sampler's pass over the logits of every new token. A GPU engine replays CUDA graphs
    and pays `forward_overhead_s` per forward (a per-kernel launch term would double count it)."""
    if n_seqs <= 0:
        return 0.0
    tokens = n_seqs * q_tokens
    t = linear_time(shape, hw, cal, tokens, tp, dtype_bytes)
    t += attention_time(shape, hw, cal, q_tokens, ctx_tokens, tp, dtype_bytes)
    if sample:
        t += sampler_time(shape, hw, cal, tokens)
    return t / cal.decode_eff + collective_time(hw, cal, shape, tokens, tp, ep) + cal.forward_overhead_s
