"""Check the CPU profile against something measurable today: a plain decode loop over a stack of torch matmuls with
a preset's weight shapes, predicted by the same roofline the simulator uses for the embedded engine.

Each layer of the loop launches the operators of a decoder layer minus attention over a cache:

    rms_norm, q/k/v linears, o linear on q (attention's stand-in), residual add,
    rms_norm, gate and up linears, silu, multiply, down linear, residual add          = 13 operators

plus an embedding lookup, a final rms_norm, the LM head and an argmax per step. The prediction is
`roofline.forward_time` with no context (no KV cache) and 13 operators per layer + 4 (each call here dispatches one
operator): the count is a fact about this loop, not a fitted constant, and the loop has no per-sequence Python;
rates and per-operator cost come from the measured `CpuProfile`.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_spec.models.config import ModelConfig
from megatron_spec.models.presets import preset

from .cpu_profile import CpuProfile, clock_for, min_time
from .model import forward_time
from .model import target_shape as shape_of

STACK_OPS_PER_LAYER = 13


def predicted_step_seconds(model: str | ModelConfig, batch: int, profile: CpuProfile) -> float:
    """Roofline time of one decode step of the matmul stack at `batch` sequences."""
    cfg = preset(model) if isinstance(model, str) else model
    shape = replace(shape_of(cfg, kv_dtype_bytes=4), ops=STACK_OPS_PER_LAYER * cfg.num_hidden_layers + 4,
                    sample_ops=0.0, seq_ops=0.0)
    hw = replace(profile.to_hardware(), seq_overhead_s=0.0)
    return forward_time(shape, hw, batch, 1, 0.0, dtype_bytes=4)


def measured_step_seconds(model: str | ModelConfig, batches: tuple[int, ...], threads: int, steps: int = 4,
                          repeats: int = 3) -> dict[int, float]:
    """Per batch size: fastest-of-`repeats` mean step time of `steps` greedy decode steps of the matmul stack."""
    import torch
    import torch.nn.functional as F

    cfg = preset(model) if isinstance(model, str) else model
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen) * cols ** -0.5

        layers = [dict(wq=w(q, h), wk=w(kv, h), wv=w(kv, h), wo=w(h, q), wg=w(f, h), wu=w(f, h), wd=w(h, f),
                       n1=torch.ones(h), n2=torch.ones(h)) for _ in range(cfg.num_hidden_layers)]
        embed = w(cfg.vocab_size, h)
        head = embed if cfg.tie_word_embeddings else w(cfg.vocab_size, h)
        norm = torch.ones(h)
        eps = cfg.rms_norm_eps

        def step(tokens: torch.Tensor) -> torch.Tensor:
            x = embed[tokens]
            for p in layers:
                a = F.rms_norm(x, (h,), p["n1"], eps)
                qv = F.linear(a, p["wq"])
                F.linear(a, p["wk"])
                F.linear(a, p["wv"])
                x = x + F.linear(qv, p["wo"])
                a = F.rms_norm(x, (h,), p["n2"], eps)
                x = x + F.linear(F.silu(F.linear(a, p["wg"])) * F.linear(a, p["wu"]), p["wd"])
            return F.linear(F.rms_norm(x, (h,), norm, eps), head).argmax(-1)

        out = {}
        with torch.inference_mode():
            for batch in batches:
                def run(batch: int = batch) -> None:
                    tokens = torch.zeros(batch, dtype=torch.long)
                    for _ in range(steps):
                        tokens = step(tokens)

                out[batch] = min_time(run, repeats, warmup=1, clock=clock_for(threads)) / steps
        return out
    finally:
        torch.set_num_threads(previous)
