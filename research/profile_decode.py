"""Where a decode step of our engine spends its time: SmolLM2-135M, plain decoding, batch 1 and 8.

Three measurements per batch size, after a prefill and a few warm-up steps:

1. wall-clock split of `LLMEngine.step()` (median over steps): embedding and rotary tables, attention modules
   (projections, rotary, KV-cache write/read and the attention itself; the cache + attention core also on its
   own), the rest of the decoder layers (norms, MLP, residuals), the output head, sampling / verification
   (`LLMEngine.accept`), and what is left: the engine's Python (scheduling, bookkeeping, appending tokens).
   Timed with forward hooks and wrappers around the runner's and engine's methods, so nothing in the package
   changes to be measured;
2. the torch profiler's per-op table over the same steps (self CPU time, top ops);
3. the weight-streaming bound at batch 1: the bytes of the weights (each tensor once, tied ones once) over the
   memory bandwidth measured here (a large tensor sum, reading only), i.e. the fastest a step that reads every
   weight once could be; held to the step as the engine runs it (`step_ms`, timed before anything is
   instrumented), block by block beside the bandwidth (`bound_over_step`).

    python research/profile_decode.py --dtype float32 --out research/records/profile_decode_smollm2_fp32.json

Timings on a shared machine are noisy; the split is a median over steps, and the profiler's shares are relative.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict

import torch

from megatron_spec.bench.common import machine
from megatron_spec.engine import LLMEngine, SamplingParams
import megatron_spec.models.layers as layers
from megatron_spec.models import from_pretrained
from megatron_spec.models.decoder import weights_fixed
from megatron_spec.models.kv_cache import BatchView


class Clock:
    """Seconds spent per label during the current step."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, name: str, label: str):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def hook(self, module: torch.nn.Module, label: str) -> None:
        start = {}
        module.register_forward_pre_hook(lambda m, a: start.__setitem__(0, time.perf_counter()))
        module.register_forward_hook(lambda m, a, o: self.step.__setitem__(
            label, self.step[label] + time.perf_counter() - start[0]))


def instrument(engine: LLMEngine, clock: Clock) -> None:
    model = engine.model
    for layer in model.model.layers:
        clock.hook(layer, "layers")
        clock.hook(layer.self_attn, "attention")
    clock.wrap(engine.runner, "logits", "lm_head")
    clock.wrap(engine, "accept", "sampling_verify")
    clock.wrap(engine.runner, "forward", "runner_forward")
    clock.wrap(BatchView, "update", "attention_core")

    if hasattr(layers, "attend"):
        clock.wrap(layers, "attend", "attention_core")


def split(clock: Clock) -> dict[str, float]:
    """Median ms per part; each step is split first (so the parts of one step add up to its time), then the median
    of each part over steps is taken. 'layers' minus 'attention' is the rest of the decoder layers, and what no
    part covers is the engine's Python."""
    parts = []
    for s in clock.steps:
        p = {
            "step_ms": s["step"],
            "attention_ms": s.get("attention", 0.0),
            "attention_core_ms": s.get("attention_core", 0.0),
            "mlp_norms_residual_ms": s.get("layers", 0.0) - s.get("attention", 0.0),
            "embed_rope_final_norm_ms": s["runner_forward"] - s.get("layers", 0.0),
            "lm_head_ms": s.get("lm_head", 0.0),
            "sampling_verify_ms": s.get("sampling_verify", 0.0),
        }
        p["engine_python_ms"] = s["step"] - s["runner_forward"] - p["lm_head_ms"] - p["sampling_verify_ms"]
        parts.append(p)
    return {k: round(1000 * statistics.median(p[k] for p in parts), 3) for k in parts[0]}


BLOCKS = 5
"""Blocks of uninstrumented steps, each timed beside its own bandwidth measurement."""


@functools.cache
def far_past_the_caches(nbytes: int = 1 << 30) -> torch.Tensor:
    """The tensor the bandwidth is read from, made (and its pages touched) once for every measurement."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def memory_bandwidth_gbs(repeats: int = 7) -> float:
    """Read bandwidth: a sum over a tensor far larger than the caches (best of `repeats`)."""
    x = far_past_the_caches()
    nbytes = x.numel() * x.element_size()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def profile_batch(model, batch: int, steps: int, greedy: bool) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, model.config.vocab_size, (batch, 32), generator=g).tolist()
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=steps * 3 + 16, ignore_eos=True)
    engine = LLMEngine(model, max_num_seqs=batch)
    with torch.inference_mode(), weights_fixed():  # as in `LLMEngine.generate`
        engine.start(prompts, params)
        for _ in range(8):  # prefill + warm-up decode steps
            engine.step()
        # The step as the engine runs it, before anything is instrumented, in blocks that alternate with the
        # bandwidth measurement: this host's speed drifts by 10-20 % between runs and within one, so the bound is
        # held to the steps timed beside it, block by block.
        plain, held, nbytes = [], [], weight_bytes(model)
        for _ in range(BLOCKS):
            bound = nbytes / (memory_bandwidth_gbs(repeats=3) * 1e9)
            block = []
            for _ in range(steps // BLOCKS):
                t0 = time.perf_counter()
                engine.step()
                block.append(time.perf_counter() - t0)
            plain += block
            held.append(bound / statistics.median(block))
        # Instrumented wall-clock split.
        clock = Clock()
        instrument(engine, clock)
        for _ in range(steps):
            clock.step = defaultdict(float)
            t0 = time.perf_counter()
            engine.step()
            clock.step["step"] = time.perf_counter() - t0
            clock.steps.append(clock.step)
        # Per-op table, over fresh steps of the same engine (the wrappers cost microseconds per step).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    table = []
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    for e in events[:25]:
        table.append({"op": e.key, "calls_per_step": e.count / steps,
                      "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                      "share": round(e.self_cpu_time_total / total, 4)})
    return {"batch": batch, "greedy": greedy, "step_ms": round(1000 * statistics.median(plain), 3),
            "bound_over_step": round(statistics.median(held), 3), "bound_over_step_blocks": [round(h, 3) for h in held],
            "wall_split": split(clock),
            "ops_per_step": sum(e.count for e in events) / steps,
            "profiler_self_ms_per_step": round(total / 1000 / steps, 3), "top_ops": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", action="store_true", help="T=0 (default: T=1 sampling)")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. the machine's load)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = from_pretrained(args.model, dtype=dtype)
    bw = memory_bandwidth_gbs()
    wb = weight_bytes(model)
    result = {"benchmark": "profile_decode", "model": args.model, "dtype": args.dtype, "machine": machine(),
              "note": args.note, "load_average": list(__import__("os").getloadavg()),
              "weight_bytes": wb, "memory_read_gb_s": round(bw, 2),
              "weight_streaming_bound_ms_b1": round(1000 * wb / (bw * 1e9), 2),
              "rows": [profile_batch(model, b, args.steps, args.greedy) for b in args.batch]}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for row in result["rows"]:
        print(f"B={row['batch']}: {row['wall_split']}  ops/step {row['ops_per_step']:.0f}")
        for op in row["top_ops"][:12]:
            print(f"    {op['op']:40s} {op['calls_per_step']:7.1f} calls  {op['self_ms_per_step']:8.3f} ms  "
                  f"{100 * op['share']:5.1f} %")
    bound = result["weight_streaming_bound_ms_b1"]
    print(f"weights {wb / 1e6:.0f} MB, read bandwidth {bw:.1f} GB/s -> bound {bound} ms")
    for row in result["rows"]:
        if row["batch"] == 1:
            print(f"B=1 step {row['step_ms']} ms (not instrumented); bound / step, median of {BLOCKS} blocks each "
                  f"held to the bandwidth measured beside it: {100 * row['bound_over_step']:.1f} % "
                  f"({', '.join(f'{100 * h:.1f}' for h in row['bound_over_step_blocks'])})")


if __name__ == "__main__":
    main()
