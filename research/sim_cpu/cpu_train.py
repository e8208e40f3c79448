"""The embedded trainer's `logprob` and `train` stages on the CPU: eager passes over length-bucketed micro-batches.

The GPU model of these stages (`megatron_spec/sim/stages.py`: FLOPs at a training MFU over packed sequences) does
not describe our embedded trainer (`trainers/embedded.py`) on a CPU, which differs in ways that each matter for a small
model:

- it sorts the rollouts longest first and cuts them greedily into micro-batches whose padded size (rows x the
  micro-batch's longest) stays within `micro_batch_tokens`, each padded only to its own longest (`micro_batches`);
  budget 0 is one batch padded to the longest rollout. The simulator cuts the workload's length quantiles, one per
  rollout (prompt + response), with the trainer's own rule and costs each micro-batch at its padded size;
- its products run at the CPU's measured rate for training-sized products (`Hardware.dense_flops`);
- the elementwise work (RMSNorm, RoPE, SwiGLU, residual adds) is not small next to the products of a 128-wide model:
  it reads and writes ~7.7 k floats per token per layer of tiny-qwen3 (`counts.activation_elements`), at `act_bw`;
- torch's fused CPU attention computes whole 32-query blocks up to the diagonal and pays `attn_score_s` per score
  beyond its FLOPs (`attention_time`), per row of each micro-batch at that micro-batch's length;
- every operator costs `op_overhead_s` in a forward without autograd, and `train_op_s` (~3-4 us against ~2.4) in
  a train step, where autograd records it and schedules its backward and the trainer's Python runs between them
  (`cpu_eager.trainer_figures`, with `train_work`, the step's arithmetic and traffic measured over modelled on
  stand-in trainers: ~1.1); a train step launches ~450 (optimizer
  included) + ~1150 per micro-batch on tiny-qwen3, more with shared prompts (counted: `counts.py`);
- with `fold_logprob` (the embedded trainer's default) the behaviour log-probs come from the train forward, so the
  `logprob` stage runs no forward: only its batch assembly, ~12 operators per rollout (~2 ms for 64 rollouts);
- with `share_prompt` (its default for dense models) each distinct prompt runs once, in a prefix pass, and each
  micro-batch computes only its rows' completions (padded to its longest completion; the cut itself is unchanged),
  attending to the prompt's recorded keys/values. Attention is then written out (`layers.attend`: every score of
  the [completion, prompt + completion] block, each read and written as a float by ~8 elementwise accesses forward
  and ~10 backward) instead of the fused kernel, and the prefix and suffix passes add their own operators.

Summed over the micro-batches b (r_b rows padded to T_b, row tokens N = sum r_b T_b; the trunk computes N, or
with shared prompts N' = prompts x prompt length + sum r_b (T_b - prompt length)):

    logprob = batch assembly ops x op_s  [+ P + A + E + ops x op_s  without the fold]
    train   = 3 P + (A_fwd + A_bwd) + 3 E + AdamW bytes / act_bw + ops x train_op_s
              P = 2 x (trunk params x N' + head params x N) / dense_flops, A attention over each micro-batch (or
              the prefix and suffix passes), E = (activation bytes of N' + logit bytes of N) / act_bw,
              ops = per-step + per-micro-batch (+ prefix and suffix pass) operators (`counts.train_ops`)

Backward costs twice the forward's products (input and weight gradients) and elementwise traffic (each gradient
reads the output gradient and a saved input and writes one tensor); attention's backward recomputes the scores and
runs five products where the forward ran two (FlashAttention-2), so 2.5x its FLOPs and 2x its score work.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.microbatch import micro_batches  # the trainer's own grouping rule (torch-free)
from megatron_spec.sim.config import SimConfig
from megatron_spec.sim.shapes import CostShape

from . import counts
from .hardware import CpuHardware as Hardware

FLOAT = 4  # the embedded trainer runs in float32
LOGIT_PASSES = 3  # the head writes the logits, log-softmax reads them and writes log-probs
SCORE_ACCESSES = 8 + 10  # `attend`'s float reads + writes per score: forward (product, scale, mask, softmax, values
#                          product) and backward (value gradient, softmax and mask backward, the two products)
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


def shares_prompt(cfg: SimConfig) -> bool:
    """The trainer computes each prompt once (`grpo.share_prompt` on a dense model whose prompts repeat)."""
    w = cfg.workload
    return bool(cfg.share_prompt) and not cfg.model_config.is_moe and w.group_size > 1 and w.prompt_len > 0


def passes(cfg: SimConfig) -> tuple[MicroBatch | None, list[MicroBatch]]:
    """The trainer's passes over one step's batch: the prefix pass over the distinct prompts (None when prompts
    are not shared) and the micro-batches, each cut to its rows' completions when they are."""
    batches = trainer_batches(cfg)
    if not shares_prompt(cfg):
        return None, batches
    p = cfg.workload.prompt_len
    return MicroBatch(cfg.workload.prompts_per_step, p), [MicroBatch(b.rows, b.length - p) for b in batches]


def padded_tokens(cfg: SimConfig) -> float:
    """Positions the trainer's forward computes per step, padding included."""
    prefix, batches = passes(cfg)
    return sum(b.tokens for b in batches) + (prefix.tokens if prefix else 0.0)


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


def written_out_attention_time(cfg: SimConfig, hw: Hardware, prefix: MicroBatch, batches: list[MicroBatch],
                               backward: bool) -> float:
    """Attention with shared prompts (`layers.attend`): the prefix pass scores its whole prompt block, each
    micro-batch every completion position against its prompt and its own completion; 4 x head_dim FLOPs per score
    forward (twice that backward) at the cache-resident matmul rate, plus the scores' elementwise traffic."""
    m = cfg.model_config
    scores = prefix.rows * prefix.length**2 + sum(b.rows * b.length * (prefix.length + b.length) for b in batches)
    scores *= m.num_attention_heads * m.num_hidden_layers
    flops, accesses = (3, SCORE_ACCESSES) if backward else (1, 8)
    return scores * (flops * 4 * m.head_dim / hw.cache_flops + accesses * FLOAT / hw.act_bw)


def assembly_time(cfg: SimConfig, hw: Hardware) -> float:
    """The logprob stage's own work: assembling the padded batch and the mismatch metric (operators only)."""
    return counts.batch_ops(cfg.workload.rollouts) * hw.op_overhead_s


def _forward_work(cfg: SimConfig, hw: Hardware, target: CostShape, backward: bool,
                  drafter: CostShape | None = None) -> tuple[float, float, float, int]:
    """Products, attention and elementwise seconds of the passes over one step's batch (forward only, or forward
    and backward), with the number of micro-batches. The trunk computes
    `padded_tokens`; the head (and a drafter training online) every position of the padded rows, because shared
    prompts are laid back into the rows before the head."""
    prefix, batches = passes(cfg)
    row_tokens = sum(b.tokens for b in trainer_batches(cfg))
    trunk_tokens = padded_tokens(cfg)
    m = cfg.model_config
    head = m.vocab_size * m.hidden_size
    row_params = head + (drafter.active_params if drafter else 0.0)
    layers = target.layers + (drafter.layers if drafter else 0)
    factor = 3 if backward else 1  # backward: input and weight gradients, each as much as the forward
    macs = (target.active_params - head) * trunk_tokens + row_params * row_tokens
    products = factor * 2 * macs / hw.dense_flops
    if prefix is None:
        attention = (attention_time(cfg, hw, target, batches, flop_factor=1 + 2.5, score_factor=1 + 2) if backward
                     else attention_time(cfg, hw, target, batches))
    else:
        attention = written_out_attention_time(cfg, hw, prefix, batches, backward)
    act = counts.activation_elements(m)
    row_elements = (layers - target.layers) * act + LOGIT_PASSES * target.vocab
    elementwise = factor * FLOAT * (target.layers * act * trunk_tokens + row_elements * row_tokens) / hw.act_bw
    return products, attention, elementwise, len(batches)


def logprob_time(cfg: SimConfig, hw: Hardware, target: CostShape) -> float:
    """The batch assembly, plus the recompute forward over every micro-batch unless it is folded into `train`."""
    if cfg.fold_logprob:
        return assembly_time(cfg, hw)
    products, attention, elementwise, n = _forward_work(cfg, hw, target, backward=False)
    ops = counts.logprob_ops(cfg.model_config, n, shared=shares_prompt(cfg),
                             groups=cfg.workload.prompts_per_step) * hw.op_overhead_s
    return assembly_time(cfg, hw) + products + attention + elementwise + ops


def train_time(cfg: SimConfig, hw: Hardware, target: CostShape, drafter: CostShape | None) -> float:
    """Forward and backward of the policy over every micro-batch, AdamW, and the drafter's own pass when it trains
    online (on the same micro-batches' detached states)."""
    online = cfg.spec is not None and cfg.spec.online_drafter_training and drafter is not None
    # the drafter learns on the policy's detached states: its own layer(s), forward and backward
    products, attention, elementwise, _ = _forward_work(cfg, hw, target, backward=True,
                                                        drafter=drafter if online else None)
    optimizer = ADAMW_ACCESSES * FLOAT * target.total_params / hw.act_bw
    work = products + attention + elementwise + optimizer
    return hw.train_work * work + train_step_ops(cfg, target, drafter if online else None) * hw.train_op_s


def train_step_ops(cfg: SimConfig, target: CostShape, drafter: CostShape | None = None) -> float:
    """Operators one `train_step` launches on this workload (`counts.train_ops`), with `drafter` training online."""
    prefix, batches = passes(cfg)
    return counts.train_ops(cfg.model_config, len(batches), fold=bool(cfg.fold_logprob), shared=prefix is not None,
                            drafter=cfg.spec.drafter if drafter is not None else None,
                            groups=cfg.workload.prompts_per_step)
