"""The embedded trainer's `logprob` and `train` stages on the CPU: eager passes over length-bucketed micro-batches.

The GPU model of these stages (`stages.py`: FLOPs at a training MFU over packed sequences) does not describe our
embedded trainer (`rl/policy.py`) on a CPU, which differs in ways that each matter for a small model:

- it sorts the rollouts longest first and cuts them greedily into micro-batches whose padded size (rows x the
  micro-batch's longest) stays within `micro_batch_tokens`, each padded only to its own longest (`micro_batches`);
  budget 0 is one batch padded to the longest rollout. The simulator cuts the workload's length quantiles, one per
  rollout (prompt + response), with the trainer's own rule and costs each micro-batch at its padded size;
- its products run at the CPU's measured rate for training-sized products (`Hardware.dense_flops`);
- the elementwise work (RMSNorm, RoPE, SwiGLU, residual adds) is not small next to the products of a 128-wide model:
  it reads and writes ~7.7 k floats per token per layer of tiny-qwen3 (`eager.activation_elements`), at `act_bw`;
- torch's fused CPU attention computes whole 32-query blocks up to the diagonal and pays `attn_score_s` per score
  beyond its FLOPs (`attention_time`), per row of each micro-batch at that micro-batch's length;
- every operator costs `op_overhead_s`, and a train step launches ~450 (optimizer included) + ~1150 per
  micro-batch on tiny-qwen3 (`eager.py`): ~2.8 ms per micro-batch at 2.4 us, what a small budget pays for;
- with `fold_logprob` (the embedded trainer's default) the behaviour log-probs come from the train forward, so the
  `logprob` stage runs no forward: only its batch assembly, ~12 operators per rollout (~2 ms for 64 rollouts).

Summed over the micro-batches b (r_b rows padded to T_b, tokens N = sum r_b T_b):

    logprob = batch assembly ops x op_s  [+ P + A + E + ops x op_s  without the fold]
    train   = 3 P + (A_fwd + A_bwd) + 3 E + AdamW bytes / act_bw + ops x op_s
              P = 2 x active params x N / dense_flops, A attention over each micro-batch, E = (activation + logit)
              bytes of N tokens / act_bw, ops = per-step + per-micro-batch operators (`eager.train_ops`)

Backward costs twice the forward's products (input and weight gradients) and elementwise traffic (each gradient
reads the output gradient and a saved input and writes one tensor); attention's backward recomputes the scores and
runs five products where the forward ran two (FlashAttention-2), so 2.5x its FLOPs and 2x its score work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rl.microbatch import micro_batches  # the trainer's own grouping rule (torch-free)
from . import eager
from .config import SimConfig
from .hardware import Hardware
from .shapes import CostShape

FLOAT = 4  # the embedded trainer runs in float32
LOGIT_PASSES = 3  # the head writes the logits, log-softmax reads them and writes log-probs
ADAMW_ACCESSES = 24  # 4-byte reads + writes per parameter: AdamW's ~8 operators over param, grad, 2 moments, + clip
MIN_ROW_LEN = 2  # the trainer keeps at least one next-token prediction per row (`microbatch.sequence_lengths`)


@dataclass(frozen=True)
class MicroBatch:
    rows: int
    """Rollouts in the micro-batch."""
    length: float
    """Tokens each row is padded to: its longest row's prompt + response."""

    @property
    def tokens(self) -> float:
        """Padded positions the forward computes."""
        return self.rows * self.length


def row_lengths(cfg: SimConfig) -> list[float]:
    """One used length per rollout: the prompt plus one of `rollouts` equally likely response lengths."""
    w = cfg.workload
    return [max(w.prompt_len + r, MIN_ROW_LEN) for r in w.response.quantiles(w.rollouts)]


def trainer_batches(cfg: SimConfig) -> list[MicroBatch]:
    """The micro-batches the embedded trainer forms from this workload's rollouts with `cfg.micro_batch_tokens`."""
    lengths = row_lengths(cfg)
    return [MicroBatch(len(rows), max(lengths[i] for i in rows))
            for rows in micro_batches(lengths, cfg.micro_batch_tokens)]


def padded_tokens(cfg: SimConfig) -> float:
    """Positions the trainer's forward computes per step, padding included."""
    return sum(b.tokens for b in trainer_batches(cfg))


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


def attention_time(cfg: SimConfig, hw: Hardware, target: CostShape, batches: list[MicroBatch],
                   flop_factor: float = 1.0, score_factor: float = 1.0) -> float:
    """Attention over the micro-batches: every (query, key) score computed costs 4 x head_dim FLOPs at the
    cache-resident matmul rate (times `flop_factor`) plus `attn_score_s` (times `score_factor`)."""
    m = cfg.model_config
    scores = m.num_attention_heads * target.layers * sum(b.rows * computed_scores(b.length) for b in batches)
    return scores * (flop_factor * 4 * m.head_dim / hw.cache_flops + score_factor * hw.attn_score_s)


def _elementwise_bytes(cfg: SimConfig, shape: CostShape, tokens: float, layers: float) -> float:
    return tokens * FLOAT * (layers * eager.activation_elements(cfg.model_config) + LOGIT_PASSES * shape.vocab)


def _experts_touched(target: CostShape, batches: list[MicroBatch]) -> float:
    """Experts touched per MoE layer, summed over the micro-batches (each routes its own tokens)."""
    return sum(target.experts_touched(b.tokens) for b in batches) if target.experts else 0.0


def assembly_time(cfg: SimConfig, hw: Hardware) -> float:
    """The logprob stage's own work: assembling the padded batch and the mismatch metric (operators only)."""
    return eager.batch_ops(cfg.workload.rollouts) * hw.op_overhead_s


def logprob_time(cfg: SimConfig, hw: Hardware, target: CostShape) -> float:
    """The batch assembly, plus the recompute forward over every micro-batch unless it is folded into `train`."""
    if cfg.fold_logprob:
        return assembly_time(cfg, hw)
    batches = trainer_batches(cfg)
    tokens = sum(b.tokens for b in batches)
    products = 2 * target.active_params * tokens / hw.dense_flops
    elementwise = _elementwise_bytes(cfg, target, tokens, target.layers) / hw.act_bw
    ops = eager.logprob_ops(cfg.model_config, len(batches), _experts_touched(target, batches)) * hw.op_overhead_s
    return assembly_time(cfg, hw) + products + attention_time(cfg, hw, target, batches) + elementwise + ops


def train_time(cfg: SimConfig, hw: Hardware, target: CostShape, drafter: CostShape | None) -> float:
    """Forward and backward of the policy over every micro-batch, AdamW, and the drafter's own pass when it trains
    online (on the same micro-batches' detached states)."""
    batches = trainer_batches(cfg)
    tokens = sum(b.tokens for b in batches)
    params = target.active_params
    layers = target.layers
    if cfg.spec is not None and cfg.spec.online_drafter_training and drafter is not None:
        params += drafter.active_params  # the drafter learns on the policy's detached states, one more layer
        layers += drafter.layers
    products = 3 * 2 * params * tokens / hw.dense_flops
    attention = attention_time(cfg, hw, target, batches, flop_factor=1 + 2.5, score_factor=1 + 2)
    elementwise = 3 * _elementwise_bytes(cfg, target, tokens, layers) / hw.act_bw
    optimizer = ADAMW_ACCESSES * FLOAT * target.total_params / hw.act_bw
    ops = eager.train_ops(cfg.model_config, len(batches), _experts_touched(target, batches),
                          fold=cfg.fold_logprob) * hw.op_overhead_s
    return products + attention + elementwise + optimizer + ops
