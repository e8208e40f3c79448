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
- `dense_flops`: a training pass's products as autograd runs them: a bias-free 128 -> 384 -> 128 MLP stand-in,
  forward and backward over a 1024-token micro-batch (8 x 128), the trainer's shape class on the models validated
  on this CPU. Autograd's backward products read transposed views of tensors other operators just wrote, and run
  ~15 % slower than the same three products timed alone on fresh contiguous inputs (~155 against ~185 GFLOP/s);
  the trainer's products, profiled inside a train step, run at the slower rate. Wider weights run faster, so for
  a wider model the trainer's products are predicted somewhat slow.
- `act_bw`: a training pass's elementwise work as autograd runs it: an RMSNorm, a head-split transpose copy, a
  SwiGLU-style product and a residual add (17 float accesses per element forward) over 2 MB activations (8 x 512
  tokens x 128), forward and backward, rotating through 24 of them (48 MB, more than the cores' caches hold, as a
  pass's saved activations are), less the operators' fixed cost (~5 %), per byte of the forward's traffic x 3 (the
  trainer model's backward = 2 x forward). 56-82 GB/s over ten calibrations here; the elementwise share of a real
  train step, read from the profiler (other operators' self time less their fixed cost), runs nearer 40, a gap
  `train_work` carries. Forward alone, or on one tensor pair,
  the same operators run up to twice as fast (inputs left in cache), which a pass does not see. (Derived before as
  a stand-in layer's forward less its products, attention and operators, this difference of timings moved
  40-110 GB/s between calibrations on this shared host.)
- `train_op_s`, `train_work`: two stand-in trainers' steps against their model (`trainer_figures`).
- `attn_score_s`: the engine's written-out grouped-query attention (`models.layers.attend`) over 64 sequences x 4
  heads, 4 queries x 64 keys each (a verify step's shape), per score, less the score's 4 x 32 FLOPs at the
  cache-resident matmul rate. Torch's fused kernel, which the trainer uses, costs about the same per score at the
  trainer's lengths (6.5 vs 6.3 ns on this machine, one thread), so one figure serves both.

Every timing is the fastest of several repeats (`cpu_profile.min_time`) on the clock `cpu_profile.clock_for`
picks, so a shared machine's preemptions are filtered where they can be.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_spec.models.config import ModelConfig

STAND_IN = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=16, max_position_embeddings=512)
SEQ_BATCHES = (1, 96)
ACT_SHAPE = (8, 512, 128)  # sequences, tokens, width of one activation tensor (2 MB), tiny-model wide
ACT_TENSORS = 24  # rotated through: 48 MB, beyond what the cores' caches hold
TRAIN_STAND_INS = (
    # (model, workload, micro-batch budget): two trainer stand-ins at the two extremes, neither a model or batch the
    # simulator is validated on. The first is mostly operators (~80 % of its modelled step): 64 wide, 2 layers,
    # 4 prompts x 8 short rollouts in 256-token micro-batches. The second is mostly arithmetic and traffic (~87 %):
    # 128 wide, 2 layers, 2 prompts x 8 rollouts of 128 positions in one batch.
    (ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, intermediate_size=192, max_position_embeddings=512),
     dict(prompts_per_step=4, group_size=8, prompt_len=8, response=dict(mean=16.0, max_tokens=48, sigma=0.4)), 256),
    (ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=512),
     dict(prompts_per_step=2, group_size=8, prompt_len=16, response=dict(mean=112.0, max_tokens=112, sigma=0.0)), 0),
)
ATTN_SHAPE = (64, 4, 2, 4, 64, 32)  # sequences, query heads, kv heads, queries, keys, head dim
DENSE_SHAPE = (8, 128, 128, 384)  # sequences, tokens, width, MLP width: a ~1000-token micro-batch, tiny-model wide


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

    from megatron_spec.models.kv_cache import KVCache
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
    """Products of a training pass per second: an MLP stand-in (DENSE_SHAPE) forward and backward through autograd,
    three products per weight (the forward x W^T, the input gradient dY W, the weight gradient dY^T x). Its dozen
    other operators cost ~30 us of the ~3 ms, so they are left in."""
    import torch

    seqs, tokens, width, inner = DENSE_SHAPE
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(width, inner, bias=False), torch.nn.Linear(inner, width, bias=False))
    x = torch.randn(seqs, tokens, width, requires_grad=True)
    grad = torch.ones(seqs, tokens, width)

    def pass_():
        mlp(x).backward(grad)

    seconds = min_time(pass_, 10, clock=clock)
    return 3 * 2 * seqs * tokens * 2 * width * inner / seconds


def act_bandwidth(clock, min_time, op_s: float) -> float:
    """Bytes per second of a training pass's elementwise operators, inputs not cache-resident (module docstring)."""
    import torch
    import torch.nn.functional as F

    from .op_census import count_ops

    count, (seqs, tokens, width), heads = ACT_TENSORS, ACT_SHAPE, 4
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(seqs, tokens, width, generator=gen, requires_grad=True) for _ in range(count)]
    weight = torch.randn(width, generator=gen, requires_grad=True)
    split = (seqs, heads, tokens, width // heads)
    ones = torch.ones(split)

    def run():
        for i in range(count):
            a, b = xs[i], xs[(i + 7) % count]
            h = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * weight  # 7 accesses per element
            t = h.view(seqs, tokens, heads, -1).transpose(1, 2).contiguous()  # 2
            y = F.silu(t) * b.view(split) + a.view(split)  # 2 + 3 + 3
            torch.autograd.grad(y, (a, b, weight), ones)

    with torch.inference_mode(False), torch.enable_grad():
        seconds = min_time(run, 10, clock=clock) - count_ops(run) * op_s
    return 3 * 17 * 4 * seqs * tokens * width * count / max(seconds, 1e-9)


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
    """The eager figures of a `CpuProfile` but `train_op_s` (which models a trainer step with these); the caller
    has set torch's thread count."""
    import torch

    with torch.inference_mode():
        op_s = op_seconds(clock, min_time)
        out = {"op_overhead_s": op_s,
               "attn_score_s": attn_score_seconds(clock, min_time, cache_flops)}
        out["seq_layer_s"] = seq_layer_seconds(clock, min_time)
    out["dense_flops"] = dense_flops(clock, min_time)  # with autograd, as the trainer runs them
    out["act_bw"] = act_bandwidth(clock, min_time, op_s)
    out["seq_overhead_s"] = max(seq_seconds(clock, min_time) - STAND_IN.num_hidden_layers * out["seq_layer_s"], 1e-9)
    return out


def trainer_step_seconds(model: ModelConfig, workload: dict, budget: int, clock, min_time, hw):
    """One `train_step` of the embedded trainer (`trainers/embedded.py`: shared prompts, folded recompute, micro-batches
    of `budget`) on random ids shaped like `workload`'s rollouts (`cpu_train.row_lengths`), timed; with the
    SimConfig that describes it."""
    import torch

    from megatron_spec.models import CausalLM
    from megatron_spec.rl.config import GRPOSection
    from megatron_spec.interfaces import Batch
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    from . import cpu_train
    from .model import cpu_config

    cfg = cpu_config(model, hw, workload, micro_batch_tokens=budget, max_num_seqs=64)
    w = cfg.workload
    lengths = [round(n) for n in cpu_train.row_lengths(cfg)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.vocab_size, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, : w.prompt_len] = ids[r - r % w.group_size, : w.prompt_len]  # a group's rollouts share its prompt
        mask[r, w.prompt_len : n] = True
    torch.manual_seed(0)
    policy = EmbeddedPolicy(CausalLM(model), GRPOSection(micro_batch_tokens=budget, share_prompt=True),
                            dict(temperature=1.0, top_k=0, top_p=1.0))
    batch = Batch(ids, mask, advantages=torch.randn(len(lengths), generator=gen))

    def step():
        batch.old_logprobs = None  # folded: the step fills them in
        policy.train_step(batch)

    with torch.inference_mode(False), torch.enable_grad():
        return min_time(step, 10, clock=clock), cfg


def trainer_figures(clock, min_time, hw) -> dict[str, float]:
    """`train_op_s` and `train_work`: one `train_step` of the embedded trainer on each of TRAIN_STAND_INS against
    its model (`cpu_train.train_time` on the profile's other figures, `hw`), solved for the cost of one trainer
    operator and a factor on the step's arithmetic and traffic (products, attention, elementwise, optimizer):

        measured_i = train_work x modelled work_i + train_op_s x operators_i,   i = the two stand-ins

    What they carry, the other micro-benchmarks cannot see. Per operator: autograd records each and schedules
    its backward, and the trainer's Python runs between them (~10 % of a tiny-model step under the profiler,
    outside any operator): ~3.2 us against 2.4 for an inference forward's operator. Per unit of work: inside a
    step, products read transposed views of tensors other operators just wrote and elementwise operators meet
    narrow rows and broadcasts, so the step's arithmetic runs ~15 % slower than the stand-in micro-benchmarks
    (`dense_flops`, `act_bw`) say. The stand-ins sit at the two extremes (module constants) so that each figure is
    pinned by the stand-in it dominates. The GPU model's training MFU plays the same part. A busy machine can give
    a nonsense solution; then the figures fall back to `op_overhead_s` and 1."""
    from . import cpu_train
    from .model import target_shape as shape_of

    rows = []
    for model, workload, budget in TRAIN_STAND_INS:
        measured, cfg = trainer_step_seconds(model, workload, budget, clock, min_time, hw)
        shape = shape_of(model, kv_dtype_bytes=4)
        work = cpu_train.train_time(cfg, replace(hw, train_op_s=0.0, train_work=1.0), shape, None)
        rows.append((work, cpu_train.train_step_ops(cfg, shape), measured))
    (w1, n1, t1), (w2, n2, t2) = rows
    det = w1 * n2 - w2 * n1
    work, op_s = (t1 * n2 - t2 * n1) / det, (w1 * t2 - w2 * t1) / det
    if not (0.5 < work < 3 and 0 < op_s < 20 * hw.op_overhead_s):
        return {"train_op_s": hw.op_overhead_s, "train_work": 1.0}
    return {"train_op_s": op_s, "train_work": work}
