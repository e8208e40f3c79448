"""How many operators our eager engine and trainer launch: the counts the CPU profile pays `op_overhead_s` for.

A 0.8 M-parameter model does almost no arithmetic per operator, so on the CPU its step time is mostly the fixed
cost of launching operators (Python, the dispatcher, allocation: a few microseconds each) and the engine's Python
work per sequence. The roofline alone predicted half of the measured `gen` time of the tiny model for that reason.

The counts below are ATen operators as the dispatcher sees them (views and in-place updates included, backward
included), taken from our own code (`megatron_spec/models`, `engine`, `spec/proposers`, `rl/policy.py`,
`rl/loop.py`) with `op_census.py`. They are facts of that code, not fitted constants: `tests/sim_cpu/test_eager.py`
recounts them on the real engine and trainer and fails when the code drifts from this table. The engine is counted
at batch 8 (a batch of 1 launches two operators fewer per layer, because its KV rows are one slice rather than an
index); the trainer with one micro-batch and with two of two rows each.

    engine forward (embedding to logits, through the KV cache)
        = FORWARD + layers x (LAYER + NORM x norms per layer) + MoE layers x (ROUTER + EXPERT x experts touched)
    a target forward that samples adds SAMPLE (verify: rejection sampling, acceptance) or SAMPLE_PLAIN (decode)
    a draft forward = its decoder layers as above + DRAFTER[kind].per_forward; once per verify step
        + DRAFTER[kind].per_step (hidden-state drafters store the target's features, right before they draft)
    the trainer runs its forwards over n length-bucketed micro-batches (`rl/microbatch.py`); per micro-batch
        logprob forward = LOGPROB_MB + layers x (LOGPROB_LAYER + LOGPROB_NORM x norms)
        train pass      = TRAIN_MB + layers x (TRAIN_LAYER + TRAIN_NORM x norms)       forward + backward + loss
    logprob stage = BATCH_FIXED + BATCH_ROW x rollouts                              batch assembly, mismatch
                  + LOGPROB_STEP + n x logprob forward + (n - 1) x MB_CROP         the recompute (not when folded)
    train step    = TRAIN_STEP + n x train pass + (n - 1) x MB_CROP (+ TRAIN_FOLD when folded)
                  + OPT_FIXED + OPT_PER_TENSOR x parameter tensors                 clipping + AdamW
    MoE layers add LOGPROB_EXPERT / TRAIN_EXPERT per expert touched, summed over the micro-batches.
    with shared prompts (`grpo.share_prompt`, `rl/prefix.py`) each pass adds, once, the prefix pass over the
    distinct prompts = its layers' usual operators + layers x PREFIX_*_LAYER + PREFIX_*, and per micro-batch (now
    a suffix pass) layers x SUFFIX_*_LAYER + SUFFIX_*_MB.

Norms per layer: 2, or 4 with QK-norm (Qwen3). Attention runs through torch's fused kernel in training and
through a few explicit operators in the engine (short query blocks), which is why the per-layer counts differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.models.config import ModelConfig

# -- engine (LLMEngine.step, ModelRunner, spec/proposers) -------------------------------------------------------
LAYER = 55
"""A decoder layer besides its RMSNorms: q/k/v/o projections, RoPE, the KV-cache write and read, grouped-query
attention written out (scores, mask, softmax, values), the SwiGLU MLP, two residual adds, reshapes."""
NORM = 8
"""One RMSNorm: square, mean, add eps, rsqrt, two multiplies, and the float cast and cast back, which dispatch
(as no-ops) under the engine's inference mode."""
FORWARD = 44
"""Once per forward: token-id tensor, KV-cache view (positions, mask, slot index), RoPE tables, embedding, final
norm, output head."""
SAMPLE = 64
"""Once per verify step (a target forward over drafts): processed log-probs, the uniforms, rejection sampling,
emitted ids, their log-probs, rollback, list conversion."""
SAMPLE_PLAIN = 22
"""Once per plain decode step (no drafts in the batch): processed log-probs, the uniforms, inverse-CDF sampling
and the sampled tokens' log-probs."""
ROUTER = 22
"""Once per MoE layer, net of the dense MLP it replaces: router, softmax, top-k, renormalisation, the expert loop's
set-up and the load-balancing statistics."""
EXPERT = 9
"""Per expert a MoE layer's tokens touch: gather its rows, its SwiGLU MLP, weight and scatter-add."""


@dataclass(frozen=True)
class DrafterOps:
    per_forward: int
    """Operators of one draft forward besides the decoder layers it runs (and, for a draft model, its forward)."""
    per_step: int
    """Operators once per verify step besides the draft forwards (counted within `propose`)."""
    per_seq: float = 0.0
    """Operators per sequence per draft forward (Python-side reads of single draft tokens)."""


DRAFTER = {
    # MTP: token ids, embedding, two norms, concatenation, eh_proj, final norm, the shared head, draft choice, the
    # drafter's KV view; per step, the target's hidden states held since the last draft are written into the
    # feature buffer (steps that do not speculate only hold them: `HiddenStateProposer.observe`).
    "mtp": DrafterOps(per_forward=74, per_step=8),
    # EAGLE-3: as MTP with its own head and no eh_proj; per step, the three captured layers are concatenated and
    # stored before the next draft (fused by fc only on the rows a round drafts from, counted with its draft forwards).
    "eagle3": DrafterOps(per_forward=64, per_step=12),
    # A draft model: its own full forward (counted like the target's) plus the draft choice; int() per token read.
    "model": DrafterOps(per_forward=9, per_step=0, per_seq=4.0),
    "ngram": DrafterOps(per_forward=0, per_step=0),
}

# -- trainer (rl/policy.py: EmbeddedPolicy.logprobs and train_step; rl/loop.py: the logprob stage) -----------
# `op_census.trainer_pass` counts each pass with one micro-batch (budget 0) and with two of two rows each; the
# difference is the per-micro-batch part, the rest the per-step part. A micro-batch of a single row launches 2-5
# operators more (a one-element row index), which no realistic budget makes common and the table leaves out.
LOGPROB_LAYER = 55
"""A decoder layer's forward without a KV cache, besides its norms (attention is torch's fused kernel)."""
LOGPROB_NORM = 6
"""One RMSNorm in that forward: the same minus the two casts, which return early outside inference mode."""
LOGPROB_MB = 41
"""Per micro-batch of the logprob forward: selecting its rows, positions, RoPE tables, embedding, final norm,
head, processed log-probs, the gather of token log-probs, `masked` (torch.where) and the write into the output."""
LOGPROB_STEP = 9
"""Once per `logprobs` call: the rows' used lengths (`sequence_lengths`) and the output tensor."""
LOGPROB_EXPERT = 17
"""Per expert touched per MoE layer in that forward (router included), per micro-batch."""
MB_CROP = 3
"""Per micro-batch shorter than the padded batch (every one but the first, which holds the longest row): the
slices that crop its ids, mask and log-probs to its own length."""
BATCH_ROW = 12
"""The logprob stage's own work per rollout (`loop.make_batch`): the row's id and log-prob tensors and the writes
of ids, completion mask and behaviour log-probs into the padded batch. Paid with or without the recompute."""
BATCH_FIXED = 10
"""Once per logprob stage: the padded batch's three tensors and the engine-vs-trainer `logprob_mismatch`, less the
slice the longest row's id write does not need (it spans the whole row)."""
TRAIN_LAYER = 155
"""A decoder layer's forward with autograd plus its backward, besides its norms."""
TRAIN_NORM = 25
"""One RMSNorm, forward and backward."""
TRAIN_MB = 134
"""Per micro-batch of `train_step`: selecting its rows, embedding, head, log-probs, `masked`, the clipped policy
loss against the whole batch's denominators, the metrics' host reads and the backward of all of it."""
TRAIN_STEP = 23
"""Once per `train_step` besides the optimizer: used lengths, the loss denominators (`LossNorm`), gradient zeroing,
the grad-norm and clipping."""
TRAIN_FOLD = 1
"""Once per `train_step` with the recompute folded in (`grpo.fold_logprob`): the tensor the forward's detached
log-probs are written into (per micro-batch the write replaces `masked` of the given ones: no change)."""
TRAIN_EXPERT = 54
"""Per expert touched per MoE layer, forward and backward (router included), per micro-batch."""
OPT_PER_TENSOR = 9
"""AdamW (torch's single-tensor loop on the CPU) per parameter tensor: step count, its .item(), two moment
updates, bias corrections, square root, division, weight decay and the update."""
OPT_FIXED = 2
"""Once per optimizer step."""

# Shared prompts (`rl/prefix.py`), counted by `op_census.trainer_pass(shared=True)` against the same batch unshared.
# The per-layer parts are the same for Qwen3 and Llama once the prefix pass's norms are counted as usual.
PREFIX_LOGPROB_LAYER = 27
"""Per layer of the prefix pass without autograd, besides that layer's usual forward: attention is written out
over the recorded keys and values (`layers.attend`) instead of the fused kernel, and they are kept."""
PREFIX_LOGPROB = 51
"""Once per `logprobs` call with shared prompts: grouping the rows by prompt, the padded prompt block, the prefix
pass's embedding and final norm."""
SUFFIX_LOGPROB_LAYER = 27
"""Per layer per micro-batch's suffix pass without autograd: the group's prompt keys/values selected and
concatenated before the completion's own, and attention written out."""
SUFFIX_LOGPROB_MB = 38
"""Per micro-batch's suffix pass: its ids and positions, the prefix mask, and laying the prompt's and the
completion's states back out as the batch's rows (a gather)."""
PREFIX_TRAIN_LAYER = 54
"""As PREFIX_LOGPROB_LAYER, forward with autograd and its backward (run once, after the last micro-batch)."""
PREFIX_TRAIN = 72
"""As PREFIX_LOGPROB, with autograd; plus the leaves cut from the prefix graph and the backward through it."""
SUFFIX_TRAIN_LAYER = 62
"""As SUFFIX_LOGPROB_LAYER, forward and backward (the gradient into the prompt's keys/values accumulates)."""
SUFFIX_TRAIN_MB = 45
"""As SUFFIX_LOGPROB_MB, forward and backward."""


@dataclass(frozen=True)
class DrafterTrainOps:
    per_step: int
    """Once per `train_step`: zeroing, clipping and AdamW over the drafter's parameter tensors."""
    per_mb: int
    """Per micro-batch: the drafter's forward on the detached states, its soft cross-entropy and its backward."""
    qk_norms: int = 0
    """With a QK-norm target, the q/k norms its layer applies per micro-batch (2 per pass through the layer)."""


DRAFTER_TRAIN = {
    # The online drafter update (`EmbeddedPolicy.drafter_step`), counted by `op_census.trainer_pass(drafter=...)`
    # against the same step without it, for a target without QK-norm; with QK-norm an MTP / EAGLE-3 layer adds its
    # two norms' parameters (OPT_PER_TENSOR each per step) and `qk_norms` norm applications per micro-batch
    # (TRAIN_NORM each). A draft model has its own config. Per micro-batch this includes measuring the drafter's
    # agreement (`drafter_train.agreement`, 13 operators per depth). A frozen drafter's agreement (one forward
    # without gradient per micro-batch) is not modelled: the simulator's frozen drafter costs the trainer nothing.
    "mtp": DrafterTrainOps(per_step=131, per_mb=411, qk_norms=2),  # one draft per position (drafter_train.drafts)
    "eagle3": DrafterTrainOps(per_step=132, per_mb=411, qk_norms=2),
    "model": DrafterTrainOps(per_step=140, per_mb=365),
}


def norms_per_layer(m: ModelConfig) -> int:
    return 4 if m.qk_norm else 2


def param_tensors(m: ModelConfig) -> int:
    """Parameter tensors of a `CausalLM` built from `m` (what the optimizer loops over)."""
    per_layer = 4 * (2 if m.attention_bias else 1) + norms_per_layer(m)
    dense = sum(not m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    moe = m.num_hidden_layers - dense
    tensors = m.num_hidden_layers * per_layer + dense * 3 + moe * (1 + 3 * m.num_experts)
    return tensors + 2 + (0 if m.tie_word_embeddings else 1)  # embedding, final norm, untied head


def forward_ops(m: ModelConfig) -> float:
    """Operators of one engine forward of `m`, MoE expert operators excluded (they depend on the batch)."""
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    return FORWARD + m.num_hidden_layers * (LAYER + NORM * norms_per_layer(m)) + moe * ROUTER


def draft_layer_ops(target: ModelConfig, layers: int) -> float:
    """Operators of `layers` decoder layers shaped like the target's (an MTP module's or EAGLE-3 head's layer)."""
    return layers * (LAYER + NORM * norms_per_layer(target))


def logprob_ops(m: ModelConfig, micro_batches: int = 1, experts_touched: float = 0.0,
                shared: bool = False) -> float:
    """Operators of the trainer's `logprobs` over `micro_batches` micro-batches; `experts_touched` per MoE layer
    summed over the micro-batches; `shared`: through shared prompts. The stage's batch assembly is `batch_ops`."""
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    layer = LOGPROB_LAYER + LOGPROB_NORM * norms_per_layer(m)
    per_mb = LOGPROB_MB + m.num_hidden_layers * layer
    ops = LOGPROB_STEP + micro_batches * per_mb + (micro_batches - 1) * MB_CROP + moe * LOGPROB_EXPERT * experts_touched
    if shared:
        ops += PREFIX_LOGPROB + m.num_hidden_layers * (layer + PREFIX_LOGPROB_LAYER)
        ops += micro_batches * (SUFFIX_LOGPROB_MB + m.num_hidden_layers * SUFFIX_LOGPROB_LAYER)
    return ops


def batch_ops(rows: float) -> float:
    """Operators of the logprob stage besides the recompute: assembling the padded batch and the mismatch metric."""
    return BATCH_FIXED + BATCH_ROW * rows


def train_ops(m: ModelConfig, micro_batches: int = 1, experts_touched: float = 0.0, fold: bool = False,
              shared: bool = False, drafter: str | None = None) -> float:
    """Operators of one `train_step` (forward, backward, clipping and AdamW) over `micro_batches` micro-batches;
    `experts_touched` per MoE layer summed over the micro-batches; `fold`: the behaviour log-probs are taken from
    this forward (`grpo.fold_logprob`); `shared`: through shared prompts; `drafter` (mtp, eagle3, model): the kind
    of drafter that trains online in the step."""
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    layer = TRAIN_LAYER + TRAIN_NORM * norms_per_layer(m)
    per_mb = TRAIN_MB + m.num_hidden_layers * layer
    passes = (TRAIN_STEP + (TRAIN_FOLD if fold else 0) + micro_batches * per_mb + (micro_batches - 1) * MB_CROP
              + moe * TRAIN_EXPERT * experts_touched)
    if shared:
        passes += PREFIX_TRAIN + m.num_hidden_layers * (layer + PREFIX_TRAIN_LAYER)
        passes += micro_batches * (SUFFIX_TRAIN_MB + m.num_hidden_layers * SUFFIX_TRAIN_LAYER)
    if drafter in DRAFTER_TRAIN:
        ops = DRAFTER_TRAIN[drafter]
        qk = m.qk_norm and ops.qk_norms > 0
        passes += ops.per_step + (2 * OPT_PER_TENSOR if qk else 0)
        passes += micro_batches * (ops.per_mb + (TRAIN_NORM * ops.qk_norms if qk else 0))
    return passes + OPT_FIXED + OPT_PER_TENSOR * param_tensors(m)


def activation_elements(m: ModelConfig) -> float:
    """Floats elementwise operators read plus write per token per decoder layer in a forward of our layer code
    (`op_census.activation_elements` recounts it): 7 per element of each RMSNorm (square, mean, two multiplies),
    3 per residual add, 10 per RoPE'd query / key element (negate, concatenate, two multiplies, add), 5 per FFN
    element (SiLU, multiply). On a GPU this traffic hides under the weight stream; on the CPU, a 128-wide model's
    activations cost as much as its products once a batch has a few hundred tokens."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    ffn = m.moe_intermediate_size * m.num_experts_per_tok if m.is_moe else m.intermediate_size
    norm_width = 2 * h + (q + kv if m.qk_norm else 0)
    return 7 * norm_width + 3 * 2 * h + 10 * (q + kv) + 5 * ffn
