"""Where does the PP2 train step of the tiny MoE spend the time the even-split pipeline model does not see?

The run of `benchmarks/megatron_schedule.py` (PP2, one schedule call, 17 micro-batches), with Megatron's
`forward_step` and `backward_step` wrapped on each rank: a rank's busy seconds (its layers, and on the last stage
the output layer and the GRPO loss, forward and backward), the rest of its time inside the schedule (waiting for
the other stage and the point-to-point exchanges), and the same busy split at PP1, where one rank runs everything;
at PP2 both paths, one schedule call per pass and one per micro-batch shape, alternating within each round.
The even-split model gives each PP2 stage half the PP1 busy time; the last stage's head and loss do not halve.
Fastest of the repeats per figure (other processes only ever add time).

    flock /tmp/ms-timing.lock python research/pp_stage_busy.py --out research/records/pp_stage_busy.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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


def run(rank: int, world: int, layout: dict, repeats: int) -> dict:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    from megatron_spec.trainers.megatron import policy as policy_module
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.models import from_pretrained
    from megatron_spec.rl.config import GRPOSection
    from megatron_spec.interfaces import Batch

    model = from_pretrained(bench.POLICY)
    b = bench.batch(model.config.vocab_size)
    policy = MegatronPolicy(model, GRPOSection(micro_batch_tokens=bench.BUDGET), bench.SAMPLING,
                            Parallelism(**layout))
    clock = {"forward": 0.0, "backward": 0.0, "schedule": 0.0}

    def wrap(fn, key):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            clock[key] += time.perf_counter() - t0
            return out
        return timed

    schedules.forward_step = wrap(schedules.forward_step, "forward")
    schedules.backward_step = wrap(schedules.backward_step, "backward")
    policy_module.run_schedule = wrap(policy_module.run_schedule, "schedule")
    modes = (True, False) if world > 1 else (True,)
    best: dict[bool, dict[str, float]] = {one: {} for one in modes}
    calls = {}
    for r in range(repeats + 1):
        for one in modes if r % 2 == 0 else modes[::-1]:
            policy.one_schedule = one
            for key in clock:
                clock[key] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            metrics = policy.train_step(Batch(b.input_ids, b.mask, b.advantages))
            dist.barrier()
            step = time.perf_counter() - t0
            calls[one] = metrics["train_schedule_calls"]
            if r:  # the first round warms up
                sample = {**clock, "step": step, "busy": clock["forward"] + clock["backward"]}
                for key, v in sample.items():
                    best[one][key] = min(best[one].get(key, v), v)
    out = {"micro_batches": [(m.batch.input_ids.shape[0], m.batch.input_ids.shape[1]) for m in policy._micros(b)]}
    for one in modes:
        best[one]["waiting_and_p2p"] = best[one]["schedule"] - best[one]["busy"]
        out["one_call" if one else "per_shape"] = {**best[one], "schedule_calls": calls[one]}
    return out


def main(argv: list[str] | None = None) -> dict:
    from megatron_spec.trainers.megatron.parallel import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"machine": f"{machine()}, {os.cpu_count()} cores, 1 thread per rank",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "command": f"flock /tmp/ms-timing.lock python research/pp_stage_busy.py --repeats {args.repeats} "
                         f"--out {args.out}",
              "load_average_before": os.getloadavg(),
              "pp1": spawn(run, 1, {}, args.repeats)[0],
              "pp2_by_rank": spawn(run, 2, dict(pp=2), args.repeats)}
    result["load_average_after"] = os.getloadavg()
    return emit(result, args.out)


if __name__ == "__main__":
    main()
