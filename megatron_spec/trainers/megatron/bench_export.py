"""Export throughput: sharded Megatron-Core model -> full HF-named tensors on every rank, in buckets.

    python -m megatron_spec.trainers.megatron.bench_export                  # Qwen3-30B-A3B shape, 8 layers + MTP, EP=2
    python -m megatron_spec.trainers.megatron.bench_export --preset qwen3-8b --layers 8 --tp 2 --ep 1

The default is the largest model that fits on the 24 GB, 2-core development machine with room to spare: Qwen3-30B-A3B's
geometry (128 experts, hidden 2048, vocab 151936) cut to 8 decoder layers + 1 MTP layer, 6.2 B parameters, 12.5 GB
in bf16 (about 6 GB of the 24 GB stayed free during the run).

Runs on local processes joined by gloo (CPU; one thread each). The model is built without Megatron's random
initialisation and filled with a constant (so every page is resident, as real weights are), exported once
untimed (warm-up), then `--repeats` times timed. Throughput is bytes of HF tensors delivered to each rank per
second: with W ranks every byte is gathered or broadcast to all W of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from megatron_spec.models import preset

from .checks import Parallelism


def _rank_main(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from .exporter import export_buckets
    from .parallel import init_model_parallel
    from .provider import build_model

    cfg = _config(args)
    par = Parallelism(tp=args["tp"], pp=args["pp"], ep=args["ep"], etp=args["etp"])
    init_model_parallel(par, cfg)
    dtype = getattr(torch, args["dtype"])
    model = build_model(cfg, par, dtype=dtype, init=False, mtp_num_layers=args["mtp_layers"])
    with torch.no_grad():  # touch every page: untouched torch.empty memory reads as the shared zero page
        for p in model.parameters():
            p.fill_(0.01 * (rank + 1))
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def one_pass() -> tuple[float, int, int, int]:
        dist.barrier()
        start, nbytes, tensors, buckets = time.perf_counter(), 0, 0, 0
        for bucket in export_buckets(model, args["bucket_mb"] * 2**20):
            buckets += 1
            tensors += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        dist.barrier()
        return time.perf_counter() - start, nbytes, tensors, buckets

    # Context for the numbers: copying up to 1 GB of this rank's weights into fresh memory (what an output byte
    # that has to be assembled costs on this machine).
    dist.barrier()
    start, copies, copied = time.perf_counter(), [], 0
    for p in model.parameters():
        if copied >= 1e9:
            break
        copies.append(p.detach().clone())
        copied += p.numel() * p.element_size()
    copy_gb_per_s = copied / (time.perf_counter() - start) / 1e9
    del copies

    one_pass()
    times = []
    for _ in range(args["repeats"]):
        seconds, nbytes, tensors, buckets = one_pass()
        times.append(seconds)
    return dict(local_bytes=local_bytes, hf_bytes=nbytes, tensors=tensors, buckets=buckets, seconds=times,
                copy=copy_gb_per_s)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _config(args: dict):
    cfg = preset(args["preset"])
    if args["layers"]:
        cfg.num_hidden_layers = args["layers"]
        cfg.mlp_only_layers = tuple(i for i in cfg.mlp_only_layers if i < args["layers"])
    return cfg


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (megatron_spec.models.presets)")
    p.add_argument("--layers", type=int, default=8, help="keep this many decoder layers (0: all)")
    p.add_argument("--mtp-layers", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--world", type=int, default=2, help="local processes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the result here")
    args = vars(p.parse_args(argv))

    from .parallel import spawn

    cfg = _config(args)
    results = spawn(_rank_main, args["world"], args)
    r0 = results[0]
    best = min(max(r["seconds"][i] for r in results) for i in range(args["repeats"]))
    total_local = sum(r["local_bytes"] for r in results)
    report = {
        "machine": f"CPU {_cpu_name()} ({os.cpu_count()} cores), {args['world']} gloo processes x 1 thread",
        "model": f"{args['preset']} with {cfg.num_hidden_layers} layers + {args['mtp_layers']} MTP, {args['dtype']}",
        "parallelism": Parallelism(tp=args["tp"], pp=args["pp"], ep=args["ep"], etp=args["etp"]).describe(),
        "params_billion": round(r0["hf_bytes"] / getattr(torch, args["dtype"]).itemsize / 1e9, 3),
        "hf_gb_per_rank": round(r0["hf_bytes"] / 1e9, 3),
        "sharded_gb_all_ranks": round(total_local / 1e9, 3),
        "tensors": r0["tensors"],
        "buckets": r0["buckets"],
        "bucket_mb": args["bucket_mb"],
        "seconds_best": round(best, 3),
        "seconds_all": [round(max(r["seconds"][i] for r in results), 3) for i in range(args["repeats"])],
        "gb_per_s_per_rank": round(r0["hf_bytes"] / best / 1e9, 3),
        "fresh_memory_copy_gb_per_s": round(min(r["copy"] for r in results), 3),
    }
    print(json.dumps(report, indent=2))
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
