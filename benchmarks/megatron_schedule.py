"""The Megatron trainer's train stage with one pipeline schedule call per pass against one call per micro-batch
shape, side by side in one run, and the simulator's train stage for the same run.

`python benchmarks/megatron_schedule.py --out research/records/megatron_schedule.json` (under
`flock /tmp/ms-timing.lock` on a shared machine). The tiny Qwen3-MoE (`checkpoints/tiny-qwen3-moe`, 4 layers,
8 experts top-2) at PP2 on 2 gloo ranks and at PP2 x EP2 on 4, 1 torch thread per rank; one batch of 32 rows of
10-token prompts and 8-40-token completions cut by a 96-token budget into >= 8 micro-batches of different lengths
per rank. Each repeat times `train_step` once with `one_schedule` and once without, alternating which goes
first, on one policy (the step's cost does not depend on the weights' values): rank 0's wall-clock seconds
between barriers, and of that the time inside `run_schedule` (forward and backward). Figures are the fastest of
the repeats (other processes only ever add time), and each round's paired ratio.

PP1 runs (1 rank, before and after the pipelined ones; the faster counts) give the costs the simulator's
pipeline model (`megatron_spec.sim.bubble.cpu_pipeline_s`: 1F1B over the micro-batches' tokens, the gloo exchanges
between stages) turns into the PP2 predictions of both paths, printed beside the measurements. The prediction
assumes each rank has a core to itself: on a loaded machine the measured PP2 times are longer by however long the
ranks wait for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_spec.bench.common import emit, machine  # noqa: E402
from megatron_spec.models import from_pretrained  # noqa: E402
from megatron_spec.rl.config import GRPOSection  # noqa: E402
from megatron_spec.interfaces import Batch  # noqa: E402

POLICY = "checkpoints/tiny-qwen3-moe"
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)
ROWS, PROMPT, BUDGET = 32, 10, 96


def batch(vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (ROWS,), generator=g)
    T = PROMPT + int(lengths.max())
    ids = torch.randint(3, vocab, (ROWS, T), generator=g)
    mask = torch.zeros(ROWS, T, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, PROMPT : PROMPT + n] = True
    return Batch(ids, mask, torch.randn(ROWS, generator=g))


def run(rank: int, world: int, layout: dict, repeats: int) -> dict:
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    from megatron_spec.trainers.megatron import policy as policy_module

    model = from_pretrained(POLICY)
    b = batch(model.config.vocab_size)
    policy = MegatronPolicy(model, GRPOSection(micro_batch_tokens=BUDGET), SAMPLING, Parallelism(**layout))
    micros = [(m.batch.input_ids.shape[0], m.batch.input_ids.shape[1]) for m in policy._micros(b)]
    in_schedule = []
    real = policy_module.run_schedule

    def timed(*args, **kw):  # the forward / backward part of the step, this rank's wall-clock
        t0 = time.perf_counter()
        out = real(*args, **kw)
        in_schedule.append(time.perf_counter() - t0)
        return out

    policy_module.run_schedule = timed
    modes = (True, False) if world > 1 else (True,)
    times = {one: [] for one in modes}
    sched = {one: [] for one in modes}
    calls = {}
    for r in range(repeats + 1):
        for one in modes if r % 2 == 0 else modes[::-1]:
            policy.one_schedule = one
            dist.barrier()
            in_schedule.clear()
            t0 = time.perf_counter()
            metrics = policy.train_step(Batch(b.input_ids, b.mask, b.advantages))
            dist.barrier()
            if r:  # the first round warms up
                times[one].append(time.perf_counter() - t0)
                sched[one].append(sum(in_schedule))
            calls[one] = metrics["train_schedule_calls"]
            pad = metrics["train_pad_fraction"]
    out = {"micro_batches": micros, "pad_fraction": pad,
           **{("one_call" if one else "per_shape"): {
               "median_s": statistics.median(times[one]), "min_s": min(times[one]), "times_s": times[one],
               "schedule_min_s": min(sched[one]), "schedule_calls": calls[one]} for one in modes}}
    if len(modes) == 2:  # per round, the two paths timed back to back: the ratio other processes disturb least
        out["paired_speedups"] = [b / a for a, b in zip(times[True], times[False])]
    return out


def main(argv: list[str] | None = None) -> dict:
    from megatron_spec.trainers.megatron.parallel import spawn
    from megatron_spec.sim.bubble import bubble_factor, cpu_pipeline_s

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"machine": f"{machine()}, {os.cpu_count()} cores, 1 thread per rank",
              "load_average_before": os.getloadavg(),
              "commit": commit, "command": "flock /tmp/ms-timing.lock python benchmarks/megatron_schedule.py "
                                           f"--repeats {args.repeats} --out research/records/megatron_schedule.json",
              "batch": f"{ROWS} rows, {PROMPT}-token prompts, 8-40-token completions, budget {BUDGET} tokens"}
    pp1 = [spawn(run, 1, {}, args.repeats)[0]]
    for name, world, layout in (("pp2", 2, dict(pp=2)), ("pp2_ep2", 4, dict(pp=2, ep=2, etp=1))):
        out = spawn(run, world, layout, args.repeats)[0]
        out["speedup_one_call"] = out["per_shape"]["min_s"] / out["one_call"]["min_s"]
        out["paired_speedup_median"] = statistics.median(out["paired_speedups"])
        result[name] = out
    pp1.append(spawn(run, 1, {}, args.repeats)[0])  # before and after the pipelined runs: the quieter one counts
    result["pp1_runs"] = pp1
    result["pp1"] = pp1 = min(pp1, key=lambda r: r["one_call"]["min_s"])
    # The simulator: at PP1 one rank runs every layer of every micro-batch (its schedule time) and the rest of the
    # step (gradient reductions, clipping, AdamW, bookkeeping). At PP2 each stage holds half the layers: the
    # schedule's part runs as 1F1B over micro-batches costed by their tokens, with each stage-to-stage exchange over
    # the host's measured gloo link; the rest stays whole (`bubble.cpu_pipeline_s`).
    pp2, one = result["pp2"], pp1["one_call"]
    m, rest = len(pp2["micro_batches"]), one["min_s"] - one["schedule_min_s"]
    with open(os.path.join(POLICY, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    result["sim_pp2"] = {}
    for path in ("one_call", "per_shape"):
        calls = pp2[path]["schedule_calls"]
        pred = cpu_pipeline_s(one["schedule_min_s"], rest, pp2["micro_batches"], hidden, pp=2,
                              one_call=path == "one_call")
        result["sim_pp2"][path] = {"predicted_s": pred, "measured_s": pp2[path]["min_s"],
                                   "error": pred / pp2[path]["min_s"] - 1,
                                   "bubble_factor": bubble_factor(m, 2, calls=calls)}
    result["load_average_after"] = os.getloadavg()
    return emit(result, args.out)


if __name__ == "__main__":
    main()
