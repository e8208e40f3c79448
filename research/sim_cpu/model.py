"""The simulator's model of our eager embedded engine and trainer on this CPU, built on the core's pieces.

The core (`megatron_spec.sim`) costs a GPU forward as rooflines plus one fixed per-forward overhead. Our embedded
engine on a CPU runs eagerly, so three things a GPU hides become most of a small model's step (README.md here
derives them):

    t_overhead = ops x op_s + n (seq_s + L seq_layer_s)      ops: counted on our code (`counts.py`)
    t_attn    += L H q C x attn_score_s                       scale, mask, softmax per (query, key) score
    t_act      = n q x act_elements x 4 B / act_bw            norms, RoPE, SwiGLU, residual adds

and each kernel's memory and arithmetic add up instead of overlapping, with weights that fit in the last-level
cache streaming at the cache's rate and a cost per output row (`CpuHardware`). The `logprob` and `train` stages
are the embedded trainer's passes over length-bucketed micro-batches (`cpu_train.py`). Generation, memory, the
`data` stage and the composition of a step are the core's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_spec.models.config import ModelConfig
from megatron_spec.models.presets import preset
from megatron_spec.sim.config import SimConfig
from megatron_spec.sim.generation import Engine, simulate_generation
from megatron_spec.sim.memory import check_fit, memory_report
from megatron_spec.sim.pipeline import StepResult, compose
from megatron_spec.sim.roofline import collective_time, sampler_time
from megatron_spec.sim.shapes import CostShape, drafter_shape, shape_of
from megatron_spec.sim.stages import data_time, refit_bytes

from . import counts, cpu_train
from .hardware import CPU, CpuHardware


@dataclass(frozen=True)
class CpuShape(CostShape):
    out_rows: float = 0.0
    """Output features summed over the always-read matrices (the CPU pays a reduction per row, `row_s`)."""
    expert_out_rows: float = 0.0
    """Output features of one expert's matrices."""
    ops: float = 0.0
    """Operators one forward launches in our eager engine, embedding to logits (`counts.py`)."""
    sample_ops: float = 0.0
    """Operators of sampling and verification after a target forward that verifies drafts (0 for drafters)."""
    plain_sample_ops: float = 0.0
    """Operators of sampling after a plain decode forward (no drafts to verify)."""
    step_ops: float = 0.0
    """Operators a drafter launches once per verify step outside its forwards (storing the target's features)."""
    seq_ops: float = 0.0
    """Operators per sequence per forward (a draft model reads each draft token back into Python)."""
    act_elements: float = 0.0
    """Floats elementwise operators read plus write per token, all layers (at `CpuHardware.act_bw`)."""


CPU_MICRO_BATCH_TOKENS = 1024
"""Default micro-batch of the embedded trainer: `GRPOSection.micro_batch_tokens` (a test holds them equal)."""


def cpu_config(model, hw: CpuHardware, workload, spec=None, micro_batch_tokens: int = CPU_MICRO_BATCH_TOKENS,
               fold_logprob: bool = True, share_prompt: bool = True, max_num_seqs: int = 1024) -> SimConfig:
    """A `SimConfig` for the embedded stack on this CPU: one device, float32 weights and KV, and the embedded
    trainer's defaults (1024-token padded micro-batches, folded recompute, shared prompts)."""
    return SimConfig(model=model, hardware=hw, gpus=1, workload=workload, spec=spec, gen_dtype_bytes=4,
                     max_num_seqs=max_num_seqs, micro_batch_tokens=micro_batch_tokens, fold_logprob=fold_logprob,
                     share_prompt=share_prompt)


def _attention_rows(m: ModelConfig) -> float:
    return (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim + m.hidden_size


def target_shape(m: ModelConfig, name: str = "model", kv_dtype_bytes: float = 4, sample: float = 0.0) -> CpuShape:
    """The core's cost shape of a decoder plus what our eager engine launches and moves per forward; `sample`: the
    operators of a verify step's sampling (counted with the drafter that verifies; 0 for a draft model)."""
    ops = counts.engine(m)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    dense_layers = m.num_hidden_layers - moe_layers
    return CpuShape(
        **vars(shape_of(m, name=name, kv_dtype_bytes=kv_dtype_bytes)),
        out_rows=_attention_rows(m) * m.num_hidden_layers + (2 * m.intermediate_size + m.hidden_size) * dense_layers
        + m.num_experts * moe_layers + m.vocab_size,
        expert_out_rows=2 * m.moe_intermediate_size + m.hidden_size, ops=ops.forward, sample_ops=sample,
        plain_sample_ops=ops.plain_sample, act_elements=m.num_hidden_layers * counts.activation_elements(m),
    )


def draft_shape(target: ModelConfig, kind: str, draft_model: str = "", layers: int = 1, draft_vocab: int = 0,
                kv_dtype_bytes: float = 4) -> CpuShape | None:
    """The core's drafter shape (None for n-gram) plus our engine's operators and traffic per draft forward."""
    if kind == "ngram":
        return None
    if kind == "model" and draft_model != "tiny-draft" or kind != "model" and layers != 1:
        raise ValueError("the CPU harness counts the drafters our engine builds: a one-layer MTP / EAGLE-3 head or "
                         f"the tiny-draft model, not {kind} {draft_model or ''} with {layers} layer(s)")
    ops = counts.engine(target, kind)
    if kind == "model":
        draft = target_shape(preset(draft_model), name=draft_model, kv_dtype_bytes=kv_dtype_bytes)
        return replace(draft, ops=ops.draft_forward, sample_ops=0.0, plain_sample_ops=0.0, seq_ops=ops.draft_seq)
    core = drafter_shape(target, kind, draft_model, layers, draft_vocab, kv_dtype_bytes)
    h = target.hidden_size
    ffn = target.intermediate_size or 4 * h
    # A head's decoder layer plus its input norms, concatenation and final norm (~25 floats per hidden unit).
    act = layers * (counts.activation_elements(target) + 25 * h)
    if kind == "eagle3":
        return CpuShape(**vars(core), out_rows=layers * (_attention_rows(target) + 2 * ffn + h) + h + core.vocab,
                        ops=ops.draft_forward, step_ops=ops.draft_step, act_elements=act)
    moe = target.is_moe
    out_rows = layers * (_attention_rows(target) + h + (core.experts if moe else 2 * ffn + h)) + target.vocab_size
    return CpuShape(**vars(core), out_rows=out_rows, expert_out_rows=2 * target.moe_intermediate_size + h,
                    ops=ops.draft_forward, step_ops=ops.draft_step, act_elements=act)


def shapes(cfg: SimConfig) -> tuple[CpuShape, CpuShape | None]:
    kv_bytes = 4 if cfg.gen_dtype_bytes == 4 else 2
    kind = cfg.spec.drafter if cfg.spec is not None else None
    sample = counts.engine(cfg.model_config, kind).sample
    target = target_shape(cfg.model_config, name=str(cfg.model), kv_dtype_bytes=kv_bytes, sample=sample)
    drafter = None
    if cfg.spec is not None:
        s = cfg.spec
        drafter = draft_shape(cfg.model_config, s.drafter, s.draft_model, s.drafter_layers, s.draft_vocab, kv_bytes)
    return target, drafter


def forward_time(shape: CpuShape, hw: CpuHardware, n_seqs: float, q_tokens: float, ctx_tokens: float,
                 tp: int = 1, ep: int = 1, dtype_bytes: float = 4, sample: bool = True) -> float:
    """Seconds for one eager forward of `n_seqs` sequences with `q_tokens` new tokens each over `ctx_tokens`."""
    if n_seqs <= 0:
        return 0.0
    tokens = n_seqs * q_tokens
    touched = shape.experts_touched(tokens)
    weight_bytes = (shape.dense_params + shape.moe_layers * touched * shape.expert_params) * dtype_bytes / tp
    bw, peak, row_s = hw.linear_rates(shape.total_params * dtype_bytes / tp, dtype_bytes)
    rows = (shape.out_rows + shape.moe_layers * touched * shape.expert_out_rows) / tp
    t = hw.roof(weight_bytes / bw, 2.0 * shape.active_params * tokens / tp / peak) + rows * row_s
    kv_bytes = ctx_tokens * shape.kv_bytes_per_token
    attn_flops = shape.attn_flops_per_token_ctx * q_tokens * ctx_tokens / tp
    t += hw.roof(kv_bytes / hw.mem_bw, attn_flops / hw.flops(max(dtype_bytes, 2)))
    t += shape.score_heads * q_tokens * ctx_tokens / tp * hw.attn_score_s
    if sample:
        t += sampler_time(shape, hw, CPU, tokens)
    if hw.act_bw:
        t += tokens * shape.act_elements * dtype_bytes / hw.act_bw / tp
    t += collective_time(hw, CPU, shape, tokens, tp, ep)
    ops = shape.ops + n_seqs * shape.seq_ops
    if sample:  # a verify step (drafts: more than one token per sequence) or a plain decode step
        ops += shape.sample_ops if tokens > n_seqs else shape.plain_sample_ops
    return t + ops * hw.op_overhead_s + n_seqs * (hw.seq_overhead_s + shape.layers * hw.seq_layer_s)


@dataclass(frozen=True)
class CpuEngine(Engine):
    """The embedded engine: eager forwards, a drafter catch-up right-padded to the batch's longest (k+1 once any
    sequence accepted every draft), and a hidden-state drafter's feature writes once per verify step."""

    def _fwd(self, shape, n, q, ctx, sample=True):
        return forward_time(shape, self.hw, n, q, ctx, self.tp, self.ep, self.dtype_bytes, sample)

    def step_time(self, n_seqs: float, ctx_tokens: float, k: int, tau: float = 1.0) -> float:
        if k == 0:
            return self._fwd(self.target, n_seqs, 1, ctx_tokens)
        t = self._fwd(self.target, n_seqs, k + 1, ctx_tokens)
        if self.drafter is not None:
            catch_up = tau if n_seqs <= 1 else k + 1
            t += self._fwd(self.drafter, n_seqs, catch_up, ctx_tokens)
            t += (k - 1) * self._fwd(self.drafter, n_seqs, 1, ctx_tokens)
            t += self.drafter.step_ops * self.hw.op_overhead_s
        return t


def simulate(cfg: SimConfig) -> StepResult:
    """One RL step of the embedded stack on this CPU: `cfg.hardware` is a `CpuHardware` (`CpuProfile.to_hardware`),
    one device, synchronous."""
    hw = cfg.hardware
    if not isinstance(hw, CpuHardware):
        raise ValueError(f"the CPU model needs a CpuHardware (CpuProfile.to_hardware()), got {hw!r}")
    if cfg.gpus != 1 or cfg.policy_lag:
        raise ValueError("the CPU model describes one process: gpus=1, policy_lag=0")
    target, drafter = shapes(cfg)
    mem = memory_report(cfg, hw, target, drafter)
    check_fit(cfg, mem)
    engine = CpuEngine(target, drafter, hw, CPU, 1, 1, cfg.gen_dtype_bytes, mem.kv_capacity_tokens,
                       cfg.max_num_seqs)
    w = cfg.workload
    gen = simulate_generation(engine, w.rollouts, w.prompt_len, w.response.quantiles(), cfg.spec)
    stages = {
        "data": data_time(cfg, CPU),
        "prepare": refit_bytes(cfg, target, drafter) / hw.mem_bw,  # one process: a copy through memory
        "gen": gen.time_s,
        "logprob": cpu_train.logprob_time(cfg, hw, target),
        "train": cpu_train.train_time(cfg, hw, target, drafter),
    }
    step, exposed = compose(cfg, stages, gen.time_s)
    return StepResult(stages=stages, step_s=step, exposed_gen_s=exposed,
                      tokens_per_step=w.rollouts * w.tokens_per_rollout, gpus=1, gen=gen, memory=mem,
                      gen_tokens=w.rollouts * w.response.expected)
