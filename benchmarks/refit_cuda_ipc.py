"""Refit between two processes on one GPU (a colocated trainer and engine): the CUDA IPC transport against the gloo
weight-update group, on the same weights, in one run. Each transport streams the same bf16 tensors in the same
buckets; the receiver copies every bucket into its own weights on the GPU and checks them bit for bit against the
sender's. Prints and writes bytes, seconds, GB/s and both sides' peak memory.

    python benchmarks/refit_cuda_ipc.py --gib 2 --out research/records/refit_cuda_ipc_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

BUCKET_BYTES = 256 << 20
ROWS = 4096


def weights(n_bytes: int, seed: int, device) -> dict[str, torch.Tensor]:
    """Seeded bf16 matrices of ROWS x ROWS (32 MiB each), `n_bytes` in all, under HF-like names."""
    g = torch.Generator(device=device).manual_seed(seed)
    count = max(1, n_bytes // (ROWS * ROWS * 2))
    return {f"model.layers.{i}.mlp.weight": torch.randn(ROWS, ROWS, generator=g, device=device, dtype=torch.float32)
            .to(torch.bfloat16) for i in range(count)}


def _member(rank: int, transport: str, port: int, n_bytes: int, result) -> None:
    from megatron_spec.distributed.weight_group import open_weight_group
    from megatron_spec.memory import peak_rss_bytes
    from megatron_spec.refit import buckets

    torch.cuda.set_device(0)
    group = open_weight_group("127.0.0.1", port, rank, 2, 120.0, transport)
    device = torch.device("cuda", 0)
    if rank == 0:
        mine = weights(n_bytes, seed=1, device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        sent = group.send(buckets(mine.items(), BUCKET_BYTES), torch.bfloat16)
        seconds = time.perf_counter() - t0
        result.put(dict(side="sender", bytes=sent, seconds=seconds,
                        extra_peak_device_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
                        peak_rss_mb=(peak_rss_bytes() or 0) / 2**20))
    else:
        target = {n: torch.zeros_like(t) for n, t in weights(n_bytes, seed=2, device=device).items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        for bucket in group.receive():
            for name, t in bucket:
                target[name].copy_(t)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        want = weights(n_bytes, seed=1, device=device)
        result.put(dict(side="receiver", seconds=seconds, bitwise_equal=all(torch.equal(target[n], want[n])
                                                                                for n in want),
                        extra_peak_device_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
                        peak_rss_mb=(peak_rss_bytes() or 0) / 2**20))
    group.close()


def refit(transport: str, n_bytes: int) -> dict:
    """One refit of `n_bytes` from a sender process to a receiver process on GPU 0; both sides' figures."""
    import torch.multiprocessing as mp

    from megatron_spec.distributed.process_groups import free_port

    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, transport, port, n_bytes, result)) for r in range(2)]
    for p in procs:
        p.start()
    sides = {}
    for _ in procs:
        r = result.get(timeout=600)
        sides[r.pop("side")] = r
    for p in procs:
        p.join(60)
    s = sides["sender"]
    return dict(transport=transport, bytes=s["bytes"], seconds=round(s["seconds"], 4),
                gb_per_s=round(s["bytes"] / s["seconds"] / 1e9, 3), sender=s, receiver=sides["receiver"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bf16 weights to refit, GiB")
    ap.add_argument("--transports", nargs="+", default=["cuda_ipc", "gloo"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    n_bytes = int(args.gib * 2**30)
    rows = [refit(t, n_bytes) for t in args.transports]
    for r in rows:
        print(f"{r['transport']:9s} {r['bytes'] / 2**30:.2f} GiB in {r['seconds']:.3f} s: {r['gb_per_s']:.1f} GB/s; "
              f"bitwise equal {r['receiver']['bitwise_equal']}; extra device peak sender "
              f"{r['sender']['extra_peak_device_mb']:.0f} MB, receiver {r['receiver']['extra_peak_device_mb']:.0f} MB")
    record = dict(machine=torch.cuda.get_device_name(0), host=platform.node(), torch=torch.__version__,
                  bucket_bytes=BUCKET_BYTES, command="python benchmarks/refit_cuda_ipc.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  commit=os.environ.get("GIT_COMMIT", ""), rows=rows)
    if len(rows) == 2 and rows[1]["gb_per_s"]:
        record["speedup_vs_" + rows[1]["transport"]] = round(rows[0]["gb_per_s"] / rows[1]["gb_per_s"], 2)
        print(f"{rows[0]['transport']} / {rows[1]['transport']}: {record['speedup_vs_' + rows[1]['transport']]}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
