"""Two versions of `megatron_spec/kernels/cpu_ops.cpp` side by side in one process: this tree's and the one at
`--before` (a git revision), each built under its own operator namespace.

`--bench linear` (the default) runs their `linear` alternately over a model's decoder projections and output head
(the weights a decode step streams; SmolLM2-135M unless `--model` names another) at each `--rows`; both must give
the same bits. The ratio is the time at `--before` over this tree's, the median of `--repeats` pairs.

`--bench ops` runs `attention` and `silu_mul` alternately at a model's head and MLP shapes (`--model`): attention
for batches of `--rows` sequences, 1 and 4 query tokens each (a decode, a k = 3 verify), keys up to 100 / 300 /
1000 positions; silu_mul for `--rows` x 1 and x 4 token rows. Same bits required; ratios as above.

`--bench engine` runs the engine on the main job's rollouts (8 prompts x 8 samples, T = 1, up to 160 tokens, EOS
stops; the shipped policy and MTP head, or a main-job checkpoint's with `--checkpoint`), plain decoding and k = 3
MTP speculation, each on both versions' kernels in turn (`kernels.ops` switched between the builds), `--repeats`
rounds after an untimed one, the order reversing each round. Both versions must generate the same tokens. Printed
and written: the before / after ratio per engine, and plain over speculative time under each version.

    python research/kernel_ab.py --before edb51cc~1 --rows 1 2 4 8 16 --out research/records/kernel_ab_X.json
    python research/kernel_ab.py --before HEAD~1 --bench ops --model checkpoints/tiny-qwen3-deep-careful --rows 1 8 64
    python research/kernel_ab.py --before HEAD~1 --bench engine --repeats 8 --out research/records/kernel_ab_Y.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megatron_spec import kernels
from megatron_spec.bench.common import machine, set_threads, write_json
from megatron_spec.models import from_pretrained
from megatron_spec.models.packed import packed


def git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def ops_of(source: str, namespace: str, workdir: Path):
    """The operators built from `source`, registered under `namespace` (two versions cannot share one), through the
    kernels' own build (same flags, cache keyed by the source)."""
    path = workdir / f"{namespace}.cpp"
    path.write_text(source.replace("TORCH_LIBRARY(megatron_spec,", f"TORCH_LIBRARY({namespace},"))
    saved, kernels.SOURCE = kernels.SOURCE, path
    try:
        torch.ops.load_library(str(kernels.build()))
    finally:
        kernels.SOURCE = saved
    return getattr(torch.ops, namespace)


def streamed_weights(model_name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    model = from_pretrained(model_name, dtype=dtype)
    return [packed(group).plain for layer in model.model.layers for group in layer.projections()] + \
        [model.lm_head.weight]


def pairs(before, after, weights, rows: int, repeats: int) -> dict:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=weights[0].dtype) for w in weights}
    for w in weights:  # the change is a speed change only
        if not torch.equal(before(inputs[w.shape[1]], w, None), after(inputs[w.shape[1]], w, None)):
            raise SystemExit(f"the two versions differ on a {tuple(w.shape)} weight at {rows} rows")

    def seconds(op) -> float:
        start = time.perf_counter()
        for w in weights:
            op(inputs[w.shape[1]], w, None)
        return time.perf_counter() - start

    seconds(before), seconds(after)  # warm
    times = [(seconds(before), seconds(after)) for _ in range(repeats)]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    return {"rows": rows, **paired_ratios(times),
            "before_ms": round(1e3 * statistics.median(b for b, _ in times), 2),
            "after_ms": round(1e3 * statistics.median(a for _, a in times), 2), "weight_mb": round(mb, 1)}


def paired_ratios(times: list[tuple[float, float]]) -> dict:
    """The (before, after) pairs' ratios, sorted, and their median."""
    ratios = sorted(b / a for b, a in times)
    return {"ratios": [round(r, 4) for r in ratios], "median": round(statistics.median(ratios), 4)}


def alternate(before, after, repeats: int, what: str) -> dict:
    """Time the zero-argument calls `before` and `after` alternately (each call repeated to ~0.1 s), after checking
    they give the same bits; their time ratio per pair, and the median."""
    if not torch.equal(before(), after()):
        raise SystemExit(f"the two versions differ on {what}")
    start = time.perf_counter()
    after()
    calls = max(5, int(0.1 / max(time.perf_counter() - start, 1e-6)))

    def seconds(op) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            op()
        return time.perf_counter() - start

    times = [(seconds(before), seconds(after)) for _ in range(repeats)]
    return {**paired_ratios(times), "after_us": round(1e6 * statistics.median(a for _, a in times) / calls, 1)}


def op_cells(before, after, model: str, rows: list[int], repeats: int) -> list[dict]:
    """attention and silu_mul of both versions at `model`'s shapes (fp32; random inputs, one slot a sequence)."""
    from megatron_spec.models.hf_io import read_config, smollm2_dir

    cfg = read_config(smollm2_dir() if model == "smollm2-135m" else model)
    H, KV, D, inner = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    cells = []
    with torch.inference_mode():
        for B in rows:
            for T in (1, 4):
                for keys in (100, 300, 1000):
                    kc, vc = torch.randn(B, KV, D, keys + T), torch.randn(B, KV, keys + T, D)
                    q, slots = torch.randn(B, T, H, D), torch.arange(B)
                    positions = torch.full((B, 1), keys - 1) + torch.arange(T)
                    cell = alternate(lambda: before.attention(q, kc, vc, slots, positions),
                                     lambda: after.attention(q, kc, vc, slots, positions), repeats,
                                     f"attention B={B} T={T} keys={keys}")
                    cells.append({"op": "attention", "batch": B, "tokens": T, "keys": keys, **cell})
                gate_up = torch.randn(B * T, 2 * inner)
                cell = alternate(lambda: before.silu_mul(gate_up), lambda: after.silu_mul(gate_up), repeats,
                                 f"silu_mul {B * T} rows")
                cells.append({"op": "silu_mul", "batch": B, "tokens": T, **cell})
    return cells


def engine_rounds(before, after, checkpoint: str | None, repeats: int) -> dict:
    """The main job's rollouts on plain and k = 3 engines under both builds' kernels in turn (see the top)."""
    from megatron_spec.bench.common import MAIN_JOB_POLICY, main_job_models
    from megatron_spec.engine import LLMEngine, SamplingParams
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.rl.train_drafter import task_prompts

    policy, head = main_job_models(None, checkpoint)
    engines = {"plain": LLMEngine(policy, max_num_seqs=64),
               "k3": LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=False), drafter=head)}
    runs = [(name, version) for name in engines for version in ("before", "after")]
    seconds: dict = {run: [] for run in runs}
    for r in range(repeats + 1):
        prompts = [q for q in task_prompts(MAIN_JOB_POLICY, 8, seed=100 + r) for _ in range(8)]
        params = SamplingParams(temperature=1.0, max_tokens=160, seed=r)
        tokens = {}
        for name, version in runs if r % 2 else runs[::-1]:
            kernels.ops = before if version == "before" else after
            start = time.perf_counter()
            tokens[name, version] = [c.token_ids for c in engines[name].generate(prompts, params)]
            if r:
                seconds[name, version].append(time.perf_counter() - start)
        kernels.ops = after
        for name in engines:
            if tokens[name, "before"] != tokens[name, "after"]:
                raise SystemExit(f"the two versions generated different tokens ({name}, round {r})")
    cells = {}
    for name in engines:
        cells[name] = {"before_s": round(sum(seconds[name, "before"]), 3),
                       "after_s": round(sum(seconds[name, "after"]), 3),
                       **paired_ratios(list(zip(seconds[name, "before"], seconds[name, "after"])))}
    for version in ("before", "after"):
        cells[f"plain_over_k3_{version}"] = round(sum(seconds["plain", version]) / sum(seconds["k3", version]), 4)
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the kernel source to compare against")
    p.add_argument("--bench", choices=["linear", "ops", "engine"], default="linear")
    p.add_argument("--model", default="smollm2-135m", help="a model name or checkpoint directory (linear, ops)")
    p.add_argument("--checkpoint", default=None, help="a main-job state.pt whose policy and drafter to load (engine)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    old = git("show", f"{args.before}:megatron_spec/kernels/cpu_ops.cpp")
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        before = ops_of(old, "ms_before", Path(tmp))
        after = ops_of(kernels.SOURCE.read_text(), "ms_after", Path(tmp))
    result = {"benchmark": "kernel_ab", "machine": machine(), "bench": args.bench,
              "before": git("rev-parse", "--short", args.before), "after": git("rev-parse", "--short", "HEAD")}
    if args.bench == "engine":
        kernels.loaded()  # the engine takes the kernels only where this tree's build loads
        cells = engine_rounds(before, after, args.checkpoint, args.repeats)
        result.update(checkpoint=args.checkpoint, rollout="main job: 8 prompts x 8 samples, T=1, max 160 tokens",
                      cells=cells)
        for name in ("plain", "k3"):
            cell = cells[name]
            print(f"{name:>5}: before {cell['before_s']} s, after {cell['after_s']} s, {cell['median']:.3f}x "
                  f"({cell['ratios'][0]:.3f}-{cell['ratios'][-1]:.3f})")
        print(f"plain / k3: before {cells['plain_over_k3_before']}, after {cells['plain_over_k3_after']}")
    elif args.bench == "ops":
        cells = op_cells(before, after, args.model, args.rows, args.repeats)
        result.update(model=args.model, dtype="float32", cells=cells)
        for cell in cells:
            shape = f"B={cell['batch']} T={cell['tokens']}" + (f" keys={cell['keys']}" if "keys" in cell else "")
            print(f"{cell['op']:>9} {shape}: {cell['after_us']} us after, {cell['median']:.3f}x "
                  f"({cell['ratios'][0]:.3f}-{cell['ratios'][-1]:.3f})")
    else:
        weights = streamed_weights(args.model, getattr(torch, args.dtype))
        cells = [pairs(before.linear, after.linear, weights, rows, args.repeats) for rows in args.rows]
        result.update(model=args.model, dtype=args.dtype, cells=cells)
        for cell in cells:
            print(f"{cell['rows']:>3} rows: before {cell['before_ms']} ms, after {cell['after_ms']} ms, "
                  f"{cell['median']:.3f}x ({cell['ratios'][0]:.3f}-{cell['ratios'][-1]:.3f})")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
