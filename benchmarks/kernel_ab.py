"""The kernels' `linear` of two versions of `megatron_spec/kernels/cpu_ops.cpp` side by side in one process: this
tree's and the one at `--before` (a git revision), each built under its own operator namespace, run alternately
over a model's decoder projections and output head (the weights a decode step streams; SmolLM2-135M unless
`--model` names another) at each `--rows`.
Both must give the same bits; the ratio is the time at `--before` over this tree's, the median of `--repeats` pairs.

    python benchmarks/kernel_ab.py --before edb51cc~1 --rows 1 2 4 8 16 --out benchmarks/results/kernel_ab_X.json
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


def linear_of(source: str, namespace: str, workdir: Path):
    """`linear` built from `source` with its operators registered under `namespace` (two versions cannot share
    one), through the kernels' own build (same flags, cache keyed by the source)."""
    path = workdir / f"{namespace}.cpp"
    path.write_text(source.replace("TORCH_LIBRARY(megatron_spec,", f"TORCH_LIBRARY({namespace},"))
    saved, kernels.SOURCE = kernels.SOURCE, path
    try:
        torch.ops.load_library(str(kernels.build()))
    finally:
        kernels.SOURCE = saved
    return getattr(torch.ops, namespace).linear


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
    ratios = sorted(b / a for b, a in times)
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    return {"rows": rows, "ratios": [round(r, 4) for r in ratios], "median": round(statistics.median(ratios), 4),
            "before_ms": round(1e3 * statistics.median(b for b, _ in times), 2),
            "after_ms": round(1e3 * statistics.median(a for _, a in times), 2), "weight_mb": round(mb, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the kernel source to compare against")
    p.add_argument("--model", default="smollm2-135m", help="a model name or checkpoint directory")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    old = git("show", f"{args.before}:megatron_spec/kernels/cpu_ops.cpp")
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        before = linear_of(old, "ms_before", Path(tmp))
        after = linear_of(kernels.SOURCE.read_text(), "ms_after", Path(tmp))
    weights = streamed_weights(args.model, getattr(torch, args.dtype))
    cells = [pairs(before, after, weights, rows, args.repeats) for rows in args.rows]
    result = {"benchmark": "kernel_ab", "machine": machine(), "model": args.model, "dtype": args.dtype,
              "before": git("rev-parse", "--short", args.before), "after": git("rev-parse", "--short", "HEAD"),
              "cells": cells}
    for cell in cells:
        print(f"{cell['rows']:>3} rows: before {cell['before_ms']} ms, after {cell['after_ms']} ms, "
              f"{cell['median']:.3f}x ({cell['ratios'][0]:.3f}-{cell['ratios'][-1]:.3f})")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
