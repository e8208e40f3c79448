"""What does one pipeline point-to-point exchange cost over gloo between two 1-thread ranks on this host?

Megatron's 1F1B over two stages meets once per micro-batch: stage 0 posts the next micro-batch's activation and
waits for the last one's gradient, stage 1 posts that gradient and waits for the activation (`isend` / `irecv`
then `wait`, `batch_p2p_comm=False` as our trainer sets it); with `variable_seq_lengths` a 3-integer shape goes
each way first. This times that exchange as a ping-pong between two gloo ranks: one round is a send each way of
the same size, so a round costs two one-way exchanges. Sizes: the shape message, and hidden 128 x 50..300 tokens
of float32 (the tiny MoE's activations in `benchmarks/megatron_schedule.py`) up to 4 MiB, so latency and
bandwidth separate (least squares of seconds on bytes). Rounds alternate the sizes; the median of each size counts.

    flock /tmp/ms-timing.lock python research/gloo_p2p.py --out research/records/gloo_p2p.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_spec.bench.common import emit, machine  # noqa: E402

SIZES = (24, 128 * 50 * 4, 128 * 100 * 4, 128 * 300 * 4, 1 << 20, 4 << 20)


def pingpong(rank: int, world: int, rounds: int) -> dict:
    import torch.distributed as dist

    peer = 1 - rank
    bufs = {n: torch.zeros(max(n // 4, 1), dtype=torch.float32) for n in SIZES}
    times = {n: [] for n in SIZES}
    for r in range(rounds + 2):
        for n in SIZES if r % 2 == 0 else SIZES[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(2):  # one exchange each way: rank 0 sends first, then rank 1
                if (rank == 0) == (_ == 0):
                    dist.isend(bufs[n], peer).wait()
                else:
                    dist.irecv(bufs[n], peer).wait()
            if r >= 2:  # two warm-up rounds
                times[n].append((time.perf_counter() - t0) / 2)
    return {str(n): statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    from megatron_spec.trainers.megatron.parallel import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)
    load = os.getloadavg()
    medians = spawn(pingpong, 2, args.rounds)[0]
    xs = [float(n) for n in medians]
    ys = list(medians.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    result = {
        "machine": f"{machine()}, {os.cpu_count()} cores, 2 gloo ranks of 1 thread",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "command": f"flock /tmp/ms-timing.lock python research/gloo_p2p.py --rounds {args.rounds} "
                   "--out research/records/gloo_p2p.json",
        "load_average_before": load, "load_average_after": os.getloadavg(),
        "one_way_median_s_by_bytes": medians,
        "latency_s": my - slope * mx, "bandwidth_bytes_per_s": 1 / slope,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
