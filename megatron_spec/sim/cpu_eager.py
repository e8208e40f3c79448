"""The CPU profile's eager-execution figures: what our engine and trainer pay beyond the weight stream.

A tiny model on the CPU spends its time launching operators and running Python per sequence, and its trainer
spends it in training-sized products, elementwise passes over activations and torch's fused attention. Each of
these is measured here once per profile (about a second), with `threads` torch threads, on stand-ins that share
the kind of work but not the case being predicted:

- `op_overhead_s`: a loop of five tiny operators (add, multiply, SiLU, RMSNorm, a 64 x 64 linear on one row), per
  operator the dispatcher sees: the cost of an operator that does no work.
- `seq_layer_s`: one decoder layer of a 16-wide stand-in model (our `DecoderLayer`, through a KV-cache view) at 1
  and 96 sequences: the slope is what each sequence adds per layer beyond arithmetic and bandwidth (rows of small
  tensors, the KV-cache write by advanced indexing, the attention mask).
- `seq_overhead_s`: our engine (`LLMEngine`) decoding with the one-layer stand-in, whose arithmetic is negligible,
  at 1 and 96 sequences: the step-time slope less `seq_layer_s` is the engine's Python work per sequence per forward
  (token lists, the per-sequence uniforms, acceptance, appending). The stand-in is not the tiny model and the batch
  is not the validation's workload; only the engine code is shared, which is the point.
- `dense_flops`: a training pass's three products per weight (forward, input gradient, weight gradient) of a
  1024-row micro-batch through a 128 x 384 weight, the trainer's shape class on the models validated on this CPU.
  Wider weights run faster (one 2048 x 256 x 512 forward product: ~185 GFLOP/s against ~160 here), so for a wider
  model the trainer's products are predicted somewhat slow.
- `act_bw`: the elementwise share of a training forward, in place: a 64-wide one-layer stand-in's forward over
  32 x 64 tokens, less its products and its attention (each timed alone) and its operators, per float read or
  written (x 4 bytes). Timed alone, the same elementwise operators run about twice as fast (their inputs stay in
  the core's cache between repeats); in a pass they do not.
- `attn_score_s`: the engine's written-out grouped-query attention (`models.layers.attend`) over 64 sequences x 4
  heads, 4 queries x 64 keys each (a verify step's shape), per score, less the score's 4 x 32 FLOPs at the
  cache-resident matmul rate. Torch's fused kernel, which the trainer uses, costs about the same per score at the
  trainer's lengths (6.5 vs 6.3 ns on this machine, one thread), so one figure serves both.

Every timing is the fastest of several repeats (`cpu_profile.min_time`) on the clock `cpu_profile.clock_for`
picks, so a shared machine's preemptions are filtered where they can be.
"""

from __future__ import annotations

from megatron_spec.models.config import ModelConfig

STAND_IN = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=16, max_position_embeddings=512)
SEQ_BATCHES = (1, 96)
ACT_STAND_IN = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=192,
                           max_position_embeddings=512)
ACT_TOKENS = (32, 64)  # sequences x tokens of the stand-in layer's forward
ATTN_SHAPE = (64, 4, 2, 4, 64, 32)  # sequences, query heads, kv heads, queries, keys, head dim
DENSE_SHAPE = (1024, 128, 384)  # rows, in, out: a ~1000-token micro-batch through a tiny-model-wide MLP weight


def op_seconds(clock, min_time) -> float:
    """Cost of one dispatched operator that does no work."""
    import torch
    import torch.nn.functional as F

    from .op_census import count_ops

    gen = torch.Generator().manual_seed(0)
    x, w64, norm_w = torch.randn(1, 64, generator=gen), torch.randn(64, 64, generator=gen), torch.ones(64)

    def mix() -> None:
        for _ in range(40):
            x + x
            x * x
            F.silu(x)
            F.rms_norm(x, (64,), norm_w)
            F.linear(x, w64)

    return min_time(mix, 30, clock=clock) / count_ops(mix)


def _slope(seconds_at) -> float:
    lo, hi = SEQ_BATCHES
    return (seconds_at(hi) - seconds_at(lo)) / (hi - lo)


def seq_layer_seconds(clock, min_time) -> float:
    """Per sequence per decoder layer: the slope of one stand-in layer's forward through a KV-cache view."""
    import torch

    from megatron_spec.engine.kv_cache import KVCache
    from megatron_spec.models.decoder import DecoderLayer
    from megatron_spec.models.layers import rope_cos_sin

    cfg = STAND_IN
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)

    def seconds_at(batch: int) -> float:
        cache = KVCache(1, batch, 64, cfg.num_key_value_heads, cfg.head_dim)
        view = cache.view(list(range(batch)), [20] * batch, 1)
        x = torch.randn(batch, 1, cfg.hidden_size)
        cos, sin = rope_cos_sin(view.positions, cfg.head_dim, cfg.rope_theta, x.dtype)

        def run() -> None:
            for _ in range(10):
                layer(x, cos, sin, view)

        return min_time(run, 20, clock=clock) / 10

    return max(_slope(seconds_at), 0.0)


def seq_seconds(clock, min_time, steps: int = 10, rounds: int = 3) -> float:
    """Per sequence per forward, one stand-in layer included: the engine's step-time slope (measure_eager takes the
    layer's share, `seq_layer_s`, off)."""
    import torch

    from megatron_spec.engine import SamplingParams

    from .op_census import PROMPT, build_engine

    engine = build_engine(STAND_IN, None, max_num_seqs=max(SEQ_BATCHES))

    def seconds_at(batch: int) -> float:
        best = float("inf")
        for r in range(rounds):
            with torch.inference_mode():
                engine.start([list(PROMPT) for _ in range(batch)],
                             SamplingParams(max_tokens=steps + 8, ignore_eos=True, seed=r))
                engine.step()  # prefill
                best = min(best, min_time(engine.step, steps, warmup=1, clock=clock))
        return best

    return _slope(seconds_at)


def dense_flops(clock, min_time) -> float:
    """The three products a training pass runs per weight, at the trainer's shape class (DENSE_SHAPE): the forward
    x W^T, the input gradient dY W and the weight gradient dY^T x, whose long reduction over the rows runs slower
    than the other two on this CPU (110-155 against 125-170 GFLOP/s at 128-384 wide, 500-1500 rows)."""
    import torch
    import torch.nn.functional as F

    rows, width, out = DENSE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen) for s in ((rows, width), (out, width), (rows, out)))
    seconds = min_time(lambda: (F.linear(x, w), dy @ w, dy.t() @ x), 10, clock=clock)
    return 3 * 2 * rows * width * out / seconds


def act_bandwidth(clock, min_time, op_s: float) -> float:
    """Elementwise traffic of a training forward, in place: a 64-wide stand-in decoder layer's forward over 32 x 64
    tokens, less its products and its fused attention (each timed alone) and its operators' fixed cost, per float
    `eager.activation_elements` counts. Timed alone, the same operators run twice as fast (their inputs stay in the
    core's cache between repeats), which is not what a pass sees."""
    import torch
    import torch.nn.functional as F

    from megatron_spec.models.decoder import DecoderLayer
    from megatron_spec.models.layers import rope_cos_sin

    from .eager import LOGPROB_LAYER, LOGPROB_NORM, activation_elements, norms_per_layer

    cfg, (b, t) = ACT_STAND_IN, ACT_TOKENS
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    x = torch.randn(b, t, cfg.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(t).expand(b, t), cfg.head_dim, cfg.rope_theta, x.dtype)
    inputs = {n: torch.randn(b * t, n) for n in (cfg.hidden_size, cfg.intermediate_size)}
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    q = torch.randn(b, cfg.num_attention_heads, t, cfg.head_dim)
    kv = torch.randn(b, cfg.num_key_value_heads, t, cfg.head_dim)
    with torch.no_grad():
        whole = min_time(lambda: layer(x, cos, sin, None), 20, clock=clock)
        products = min_time(lambda: [F.linear(inputs[m.in_features], m.weight) for m in linears], 20, clock=clock)
        attention = min_time(lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True), 20,
                             clock=clock)
    ops = (LOGPROB_LAYER + LOGPROB_NORM * norms_per_layer(cfg)) * op_s
    rest = max(whole - products - attention - ops, 1e-9)
    return 4 * activation_elements(cfg) * b * t / rest


def attn_score_seconds(clock, min_time, cache_flops: float) -> float:
    import torch

    from megatron_spec.models.layers import attend

    b, h, kv, t, keys, d = ATTN_SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, h, t, d, generator=gen), *(torch.randn(b, kv, keys, d, generator=gen) for _ in "kv")
    mask = (torch.arange(keys)[None, :] <= torch.arange(keys - t, keys)[:, None]).expand(b, 1, t, keys)
    seconds = min_time(lambda: attend(q, k, v, mask), 20, clock=clock)
    return max(seconds / (b * h * t * keys) - 4 * d / cache_flops, 1e-12)


def measure_eager(clock, min_time, cache_flops: float) -> dict[str, float]:
    """The six eager figures of a `CpuProfile`; the caller has set torch's thread count."""
    import torch

    with torch.inference_mode():
        op_s = op_seconds(clock, min_time)
        out = {"op_overhead_s": op_s, "dense_flops": dense_flops(clock, min_time),
               "act_bw": act_bandwidth(clock, min_time, op_s),
               "attn_score_s": attn_score_seconds(clock, min_time, cache_flops)}
        out["seq_layer_s"] = seq_layer_seconds(clock, min_time)
    out["seq_overhead_s"] = max(seq_seconds(clock, min_time) - STAND_IN.num_hidden_layers * out["seq_layer_s"], 1e-9)
    return out
