"""The embedded trainer's `logprob` and `train` stages on the CPU: eager passes over one padded batch.

The GPU model of these stages (`stages.py`: FLOPs at a training MFU over packed sequences) does not describe our
embedded trainer (`rl/policy.py`) on a CPU, which differs in ways that each matter for a small model:

- it pads every rollout to the batch's longest (prompt + longest response), so it computes rollouts x T tokens;
- its products run at the CPU's measured rate for training-sized products (`Hardware.dense_flops`);
- the elementwise work (RMSNorm, RoPE, SwiGLU, residual adds) is not small next to the products of a 128-wide model:
  it reads and writes ~7.7 k floats per token per layer of tiny-qwen3 (`eager.activation_elements`), at `act_bw`;
- torch's fused CPU attention computes whole 32-query blocks up to the diagonal and pays `attn_score_s` per score
  beyond its FLOPs (`attention_time`);
- every operator costs `op_overhead_s`, and a train step launches ~1600 on tiny-qwen3 (`eager.py`).

    logprob = P + A + E + ops x op_s            P = 2 x active params x tokens / dense_flops, A attention,
    train   = 3 P + (A_fwd + A_bwd) + 3 E         E = (activation + logit) bytes / act_bw
              + AdamW bytes / act_bw + ops x op_s

Backward costs twice the forward's products (input and weight gradients) and elementwise traffic (each gradient
reads the output gradient and a saved input and writes one tensor); attention's backward recomputes the scores and
runs five products where the forward ran two (FlashAttention-2), so 2.5x its FLOPs and 2x its score work.
"""

from __future__ import annotations

from . import eager
from .config import SimConfig
from .hardware import Hardware
from .shapes import CostShape

FLOAT = 4  # the embedded trainer runs in float32
LOGIT_PASSES = 3  # the head writes the logits, log-softmax reads them and writes log-probs
ADAMW_ACCESSES = 24  # 4-byte reads + writes per parameter: AdamW's ~8 operators over param, grad, 2 moments, + clip


def padded_len(cfg: SimConfig) -> float:
    """Tokens per row of the trainer's batch: the prompt plus the longest response (every row is padded to it)."""
    w = cfg.workload
    return w.prompt_len + max(w.response.quantiles())


def computed_scores(t: float) -> float:
    """(query, key) scores torch's CPU flash attention computes for one causal head of `t` tokens: queries go in
    blocks of 32 (64 from 192 tokens, 256 from 768), each block against every key up to its last query."""
    block = 256 if t >= 768 else 64 if t >= 192 else 32
    total, start = 0.0, 0.0
    while start < t:
        rows = min(block, t - start)
        total += rows * (start + rows)
        start += block
    return total


def attention_time(cfg: SimConfig, hw: Hardware, target: CostShape, seq_len: float,
                   flop_factor: float = 1.0, score_factor: float = 1.0) -> float:
    """Attention over one padded batch: every (query, key) score computed costs 4 x head_dim FLOPs at the
    cache-resident matmul rate (times `flop_factor`) plus `attn_score_s` (times `score_factor`)."""
    m = cfg.model_config
    scores = cfg.workload.rollouts * m.num_attention_heads * target.layers * computed_scores(seq_len)
    return scores * (flop_factor * 4 * m.head_dim / hw.cache_flops + score_factor * hw.attn_score_s)


def _elementwise_bytes(cfg: SimConfig, shape: CostShape, tokens: float, layers: float) -> float:
    return tokens * FLOAT * (layers * eager.activation_elements(cfg.model_config) + LOGIT_PASSES * shape.vocab)


def logprob_time(cfg: SimConfig, hw: Hardware, target: CostShape) -> float:
    t_len = padded_len(cfg)
    tokens = cfg.workload.rollouts * t_len
    products = 2 * target.active_params * tokens / hw.dense_flops
    elementwise = _elementwise_bytes(cfg, target, tokens, target.layers) / hw.act_bw
    touched = target.experts_touched(tokens) if target.experts else 0.0
    ops = eager.logprob_ops(cfg.model_config, touched) * hw.op_overhead_s
    return products + attention_time(cfg, hw, target, t_len) + elementwise + ops


def train_time(cfg: SimConfig, hw: Hardware, target: CostShape, drafter: CostShape | None) -> float:
    """Forward and backward of the policy, AdamW, and the drafter's own pass when it trains online."""
    m = cfg.model_config
    t_len = padded_len(cfg)
    tokens = cfg.workload.rollouts * t_len
    params = target.active_params
    layers = target.layers
    if cfg.spec is not None and cfg.spec.online_drafter_training and drafter is not None:
        params += drafter.active_params  # the drafter learns on the policy's detached states, one more layer
        layers += drafter.layers
    products = 3 * 2 * params * tokens / hw.dense_flops
    attention = attention_time(cfg, hw, target, t_len, flop_factor=1 + 2.5, score_factor=1 + 2)
    elementwise = 3 * _elementwise_bytes(cfg, target, tokens, layers) / hw.act_bw
    optimizer = ADAMW_ACCESSES * FLOAT * target.total_params / hw.act_bw
    touched = target.experts_touched(tokens) if target.experts else 0.0
    ops = eager.train_ops(m, touched) * hw.op_overhead_s
    return products + attention + elementwise + optimizer + ops
