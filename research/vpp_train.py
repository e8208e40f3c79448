"""Is the PP2 train step of the tiny MoE faster with interleaved virtual pipeline stages (VP2) on this CPU host?

`benchmarks/megatron_schedule.py`'s run (the tiny Qwen3-MoE, 4 layers, at PP2 on 2 gloo ranks, 1 torch thread per
rank; 32 rows of 10-token prompts and 8-40-token completions, a 96-token budget: >= 8 micro-batches of different
lengths per rank, one schedule call per pass) at VP1 (layers 0-1 | 2-3) and VP2 (chunks 0, 2 | 1, 3). Parallel
state is process-global, so each layout runs in its own pair of processes: rounds alternate which layout goes
first, each timing `train_step` `--steps` times after one warm-up step (rank 0's wall clock between barriers;
the fastest step of the round counts, since other processes only ever add time). Reported: per round the VP2 /
VP1 ratio of those minima, and the median over rounds. The interleaved schedule halves the fill and drain but
sends each micro-batch's activations between the ranks twice as often.

    flock /tmp/ms-timing.lock python research/vpp_train.py --out research/records/vpp_train.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_spec.bench.common import emit, machine  # noqa: E402

_spec = importlib.util.spec_from_file_location("megatron_schedule", os.path.join(ROOT, "benchmarks",
                                                                                 "megatron_schedule.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def run(rank: int, world: int, vp: int, steps: int) -> dict:
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.models import from_pretrained
    from megatron_spec.rl.config import GRPOSection

    model = from_pretrained(bench.POLICY)
    b = bench.batch(model.config.vocab_size)
    policy = MegatronPolicy(model, GRPOSection(micro_batch_tokens=bench.BUDGET), bench.SAMPLING,
                            Parallelism(pp=2, vp=vp))
    times, calls = [], []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        metrics = policy.train_step(b)
        dist.barrier()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
        calls.append(metrics["train_schedule_calls"])
    return {"step_s": times, "micro_batches": len(policy._micros(b)), "schedule_calls": calls}


def main(argv: list[str] | None = None) -> dict:
    from megatron_spec.trainers.megatron.parallel import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before, rounds = os.getloadavg(), []
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        got = {vp: spawn(run, 2, vp, args.steps)[0] for vp in order}
        rounds.append({"order": list(order), "vp1": got[1], "vp2": got[2],
                       "ratio_vp2_over_vp1": min(got[2]["step_s"]) / min(got[1]["step_s"])})
    ratios = [x["ratio_vp2_over_vp1"] for x in rounds]
    result = {"machine": f"{machine()}, {os.cpu_count()} cores, 1 thread per rank, shared with other jobs",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "command": f"flock /tmp/ms-timing.lock python research/vpp_train.py --rounds {args.rounds} "
                         f"--steps {args.steps} --out {args.out}",
              "load_average_before": load_before, "rounds": rounds,
              "median_ratio_vp2_over_vp1": statistics.median(ratios),
              "fastest_step_s": {f"vp{v}": min(min(x[f"vp{v}"]["step_s"]) for x in rounds) for v in (1, 2)}}
    result["load_average_after"] = os.getloadavg()
    return emit(result, args.out)


if __name__ == "__main__":
    main()
