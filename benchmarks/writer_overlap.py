"""Where does a background checkpoint write slow the step it overlaps: the GIL, or the CPU? A training-step proxy
(fwd + bwd + Adam of an MLP, Python-heavy like a real step) timed alone and while the same host tensors are
written the way Megatron's `torch_dist` writer writes them (`torch.save` of each tensor into its file, then
`fsync`), by a thread of the stepping process (today's writer, niced) and by a spawned process (the tensors in
shared memory, handed over without a copy). Also the write alone, split into its serialization (into a null
sink) and the same bytes written raw, so the CPU in the write is seen apart from the disk.

    python benchmarks/writer_overlap.py --out research/records/writer_overlap.json

The record keeps `os.getloadavg()` before and after: on a machine other jobs share, the ratios are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Null:
    """A file that drops what it is given: serialization's own cost."""

    def write(self, b):
        return len(memoryview(b).cast("B"))

    def flush(self):
        pass


def write_tensors(tensors: list, out_dir: str, nice: bool) -> float:
    """As the `torch_dist` writer: each tensor `torch.save`d into a file, flushed and fsynced."""
    from megatron_spec.rl.checkpoint import lower_priority

    if nice:
        lower_priority()
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        with open(os.path.join(out_dir, f"t{i}.pt"), "wb") as f:
            torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def _child(tensors, out_dir, done):
    done.put(write_tensors(tensors, out_dir, True))


def step_proxy(width: int, depth: int, rows: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(rows, width)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(4):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    return step


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="bytes written per save (fp32 tensors of 16 MB)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    n = max(1, int(args.gb * (1 << 30) / (16 << 20)))
    tensors = [torch.randn(4 << 20) for _ in range(n)]
    for t in tensors:
        t.share_memory_()
    step = step_proxy(args.width, args.depth, args.rows)
    step()

    def steps_during(start) -> dict:
        """Steps back to back until the write ends (at least one): their median and the write's seconds."""
        with tempfile.TemporaryDirectory(dir=ROOT) as d:
            wait = start(d)
            times = [step()]
            while not wait(False):
                times.append(step())
            return {"step_s": statistics.median(times), "steps": len(times), "write_s": wait(True)}

    def thread_writer(d):
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("s", write_tensors(tensors, d, True)))
        th.start()
        return lambda block: (th.join(), box["s"])[1] if block else not th.is_alive()

    ctx = mp.get_context("spawn")

    def process_writer(d):
        done = ctx.Queue()
        proc = ctx.Process(target=_child, args=(tensors, d, done))
        proc.start()
        box = {}

        def wait(block):
            if "s" not in box and (block or not done.empty()):
                box["s"] = done.get()
                proc.join()
            return box["s"] if block else "s" in box
        return wait

    rounds = []
    for _ in range(args.rounds):
        r = {"none": statistics.median(step() for _ in range(3))}
        r["thread"] = steps_during(thread_writer)
        r["process"] = steps_during(process_writer)
        with tempfile.TemporaryDirectory(dir=ROOT) as d:
            r["write_alone_s"] = write_tensors(tensors, d, False)
            t0 = time.perf_counter()
            for t in tensors:
                torch.save(t, Null())
            r["serialize_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i, t in enumerate(tensors):
                with open(os.path.join(d, f"raw{i}"), "wb") as f:
                    f.write(memoryview(t.numpy()).cast("B"))
                    f.flush()
                    os.fsync(f.fileno())
            r["raw_write_s"] = time.perf_counter() - t0
        rounds.append(r)
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    record = {
        "question": "does a background write slow the step it overlaps through the GIL (thread) or the CPU?",
        "command": "python benchmarks/writer_overlap.py " + " ".join(argv or sys.argv[1:]),
        "bytes": n * (16 << 20), "torch_threads": args.threads, "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "median": {"none_step_s": med(lambda r: r["none"]),
                   "thread_step_over_none": med(lambda r: r["thread"]["step_s"] / r["none"]),
                   "process_step_over_none": med(lambda r: r["process"]["step_s"] / r["none"]),
                   "thread_write_s": med(lambda r: r["thread"]["write_s"]),
                   "process_write_s": med(lambda r: r["process"]["write_s"]),
                   "write_alone_s": med(lambda r: r["write_alone_s"]),
                   "serialize_s": med(lambda r: r["serialize_s"]), "raw_write_s": med(lambda r: r["raw_write_s"])},
        "rounds": rounds,
    }
    print(json.dumps(record["median"], indent=1), "load", record["loadavg_before"], record["loadavg_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
