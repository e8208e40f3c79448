"""Host cost of an engine iteration: plain (k = 0) and MTP-speculative (k = 3) decode steps at 192 sequences, this
tree's engine against the one at `--before` (a git revision), alternately in one process.

On an H100 the main job's models are so small that a step is Python and kernel launches, not arithmetic. The proxy
here keeps that regime on the CPU: torch's ops (the CPU kernels off, `MEGATRON_SPEC_KERNELS=0`, which is the path a
CUDA forward takes) at one thread, on two model pairs:

- `small`: the main job's shape (8 layers, vocabulary 64) at hidden 32 with one head, random weights and a random
  one-layer MTP head; EOS ignored, so all 192 sequences run every step;
- `main`: the shipped policy and MTP head (`checkpoints/tiny-qwen3-deep-careful*`, hidden 96) on the main job's
  prompts (24 x 8 samples, T = 1), 96 tokens each with EOS ignored (so the batch stays whole), where drafts stand
  about as often as in the main job.

`--before`'s package is extracted from git into a temporary directory and imported as `megatron_spec_before`
(the engine, spec and model code import each other relatively). Each round runs every (model, k, version) once,
the order reversing each round, and times every `LLMEngine.step()`; the steps at the full batch are kept, whole
and less the time inside the models' forwards (`outside_models_ms`: the engine's own work, which is what differs).
Both versions must generate the same tokens and log-probs, bit for bit. Then, per (model, k, version), a short run
counts the torch operators a decode step dispatches inside and outside the models (each a kernel launch on a GPU)
and its reads of device values back to the host (each a wait for the device on a GPU), and a run under cProfile
lists where a step's time goes.

    python research/engine_overhead/run.py --before 33979a0~1 --rounds 5 --out research/records/engine_overhead_X.json
    python research/engine_overhead/run.py --before 33979a0~1 --rounds 5 --device cuda --models main small
"""

from __future__ import annotations

import os

os.environ["MEGATRON_SPEC_KERNELS"] = "0"  # before any import of the package: torch's ops, as on a GPU

import argparse
import cProfile
import importlib
import io
import json
import pstats
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
BATCH = 192


def before_package(rev: str, workdir: Path):
    """The package at git revision `rev`, imported as `megatron_spec_before`."""
    data = subprocess.run(["git", "archive", rev, "megatron_spec"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(workdir, filter="data")
    (workdir / "megatron_spec").rename(workdir / "megatron_spec_before")
    sys.path.insert(0, str(workdir))
    return importlib.import_module("megatron_spec_before")


def models(pkg, name: str):
    """(policy, MTP head) of the `small` or `main` proxy, built by `pkg`'s own classes on the CPU."""
    m = importlib.import_module(f"{pkg.__name__}.models")
    if name == "main":
        policy = m.from_pretrained(ROOT / "checkpoints/tiny-qwen3-deep-careful")
        return policy, m.load_drafter(ROOT / "checkpoints/tiny-qwen3-deep-careful-mtp", policy.config)
    cfg = m.preset("tiny-qwen3-deep")
    cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size = 32, 1, 64
    torch.manual_seed(0)
    policy = m.CausalLM(cfg).eval()
    policy.reset_parameters(std=0.15)  # peaked distributions, as a trained policy's
    return policy, m.MTP(cfg, m.MTPConfig(1))


def engines(pkg, name: str, device: str = "cpu") -> dict:
    LLMEngine = importlib.import_module(f"{pkg.__name__}.engine").LLMEngine
    SpecConfig = importlib.import_module(f"{pkg.__name__}.spec.config").SpecConfig
    policy, head = (m.to(device) for m in models(pkg, name))
    return {0: LLMEngine(policy, max_num_seqs=BATCH),
            3: LLMEngine(policy, max_num_seqs=BATCH, spec=SpecConfig("mtp", 3), drafter=head)}


def workload(name: str, r: int):
    """(prompts, params kwargs) of round r."""
    from megatron_spec.rl.train_drafter import task_prompts

    prompts = [q for q in task_prompts(str(ROOT / "checkpoints/tiny-qwen3-deep-careful"), BATCH // 8, seed=100 + r)
               for _ in range(8)]
    if name == "small":
        return prompts, dict(temperature=1.0, max_tokens=48, seed=r, ignore_eos=True)
    return prompts, dict(temperature=1.0, max_tokens=96, seed=r, ignore_eos=True)


class ModelClock:
    """Seconds spent in the models' forwards (the target's trunk and output head, the MTP head's depths and logits)
    since the last `reset`: a step's time less this is the engine's own work, what the two versions differ in."""

    def __init__(self):
        self.seconds = 0.0
        self.inside = 0  # > 0 while a model's forward runs

    def wrap(self, owner, name: str) -> None:
        """Time `owner.name` (once: a model shared by two engines is wrapped once)."""
        inner = getattr(owner, name)
        if getattr(inner, "timed", False):
            return

        def timed(*args, **kwargs):
            start = time.perf_counter()
            self.inside += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self.inside -= 1
                self.seconds += time.perf_counter() - start

        timed.timed = True
        setattr(owner, name, timed)

    def attach(self, pkg, engine) -> None:
        self.wrap(importlib.import_module(f"{pkg.__name__}.engine.runner").ModelRunner, "logits")
        self.wrap(engine.model, "trunk")
        head = getattr(engine.proposer, "head", None)
        if head is not None:
            for name in ("state", "store", "logits"):
                self.wrap(head, name)


CLOCK = ModelClock()


def timed_generate(pkg, engine, prompts, params: dict):
    """(completions as (tokens, logprobs), [(batch, seconds, seconds outside the models)] of each decode step)."""
    SamplingParams = importlib.import_module(f"{pkg.__name__}.engine").SamplingParams
    weights_fixed = importlib.import_module(f"{pkg.__name__}.models.decoder").weights_fixed
    seqs = engine.start(prompts, SamplingParams(**params))
    CLOCK.attach(pkg, engine)
    steps = []
    with torch.inference_mode(), weights_fixed():
        while not engine.scheduler.is_finished():
            prefill, batch = bool(engine.scheduler.waiting), len(engine.scheduler.running)
            CLOCK.seconds = 0.0
            start = time.perf_counter()
            engine.step()
            if not prefill:
                took = time.perf_counter() - start
                steps.append((batch, took, took - CLOCK.seconds))
    return [(s.output, s.logprobs) for s in seqs], steps


class OpCount(TorchDispatchMode):
    """Counts the torch operators dispatched inside the models' forwards and outside them (the engine's own): on a
    GPU each is a kernel launch or at least a dispatch, which is what a step of these tiny models costs there."""

    def __init__(self):
        super().__init__()
        self.model = self.engine = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if CLOCK.inside:
            self.model += 1
        else:
            self.engine += 1
        return func(*args, **(kwargs or {}))


def op_counts(pkg, engine, prompts, params: dict) -> dict:
    """Median torch operators per decode step, in the models and outside them, and the reads of device values
    back to the host (`tolist`, `item`; on a GPU each waits for the device to finish what was queued)."""
    counter, reads, per_step = OpCount(), [0], []
    original_step, saved = engine.step, (torch.Tensor.tolist, torch.Tensor.item)

    def counted(read):
        def wrapper(self, *args):
            reads[0] += 1
            return read(self, *args)
        return wrapper

    def step():
        counter.model = counter.engine = reads[0] = 0
        prefill = bool(engine.scheduler.waiting)
        original_step()
        if not prefill:
            per_step.append((counter.model, counter.engine, reads[0]))

    engine.step = step
    torch.Tensor.tolist, torch.Tensor.item = counted(saved[0]), counted(saved[1])
    try:
        with counter:
            timed_generate(pkg, engine, prompts, {**params, "max_tokens": 12})
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved
        del engine.step
    return {"model_ops": statistics.median(m for m, _, _ in per_step),
            "engine_ops": statistics.median(e for _, e, _ in per_step),
            "host_reads": statistics.median(r for _, _, r in per_step)}


def profile(pkg, engine, prompts, params: dict, top: int) -> list[dict]:
    """The `top` functions by own time over one generate, per decode step (microseconds)."""
    prof = cProfile.Profile()
    prof.enable()
    _, steps = timed_generate(pkg, engine, prompts, params)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    n = len(steps)
    return [{"function": f"{Path(f).name}:{line}:{fn}", "calls_per_step": round(cc / n, 1),
             "own_us_per_step": round(tt / n * 1e6, 1), "cum_us_per_step": round(ct / n * 1e6, 1)}
            for (f, line, fn), (cc, nc, tt, ct, _) in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the engine to compare against")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", nargs="+", default=["small", "main"], choices=["small", "main"])
    p.add_argument("--top", type=int, default=25, help="functions listed per cProfile run")
    p.add_argument("--device", default="cpu", help="cuda: the same rounds on a GPU, where the models' forwards are "
                   "launches too (`outside_models_ms` then counts only the host's side)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import megatron_spec as after_pkg
    from megatron_spec.bench.common import machine

    workdir = Path(tempfile.mkdtemp())
    before_pkg = before_package(args.before, workdir)
    versions = {"before": before_pkg, "after": after_pkg}
    result = {"benchmark": "engine_overhead", "machine": machine(args.device), "before": args.before,
              "after": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip() + "+tree",
              "command": "python research/engine_overhead/run.py " + " ".join(sys.argv[1:]),
              "proxy": f"MEGATRON_SPEC_KERNELS=0 (torch ops), 1 thread, {args.device}, 192 sequences, MTP k = 3 "
                       "without adaptation",
              "models": {}}
    for name in args.models:
        built = {v: engines(pkg, name, args.device) for v, pkg in versions.items()}
        runs = [(k, v) for k in (0, 3) for v in versions]
        times = {run: [] for run in runs}
        emitted = verify_rows = 0  # tokens and sequence-steps of the speculative runs: the acceptance length
        for r in range(args.rounds + 1):  # round 0 warms up, untimed
            prompts, params = workload(name, r)
            outputs = {}
            for k, v in runs if r % 2 else runs[::-1]:
                outputs[k, v], steps = timed_generate(versions[v], built[v][k], prompts, params)
                if r:
                    times[k, v] += [(s, host) for b, s, host in steps if b == BATCH]
                if r and (k, v) == (3, "after"):
                    emitted += sum(len(tokens) for tokens, _ in outputs[k, v])
                    verify_rows += sum(b for b, _, _ in steps)
            for k in (0, 3):
                if outputs[k, "before"] != outputs[k, "after"]:
                    raise SystemExit(f"{name}, k={k}, round {r}: the two versions generated different outputs")
        cell = {}
        for k, v in runs:
            cell[f"k{k}_{v}_ms"] = round(statistics.median(s for s, _ in times[k, v]) * 1e3, 3)
            cell[f"k{k}_{v}_outside_models_ms"] = round(statistics.median(h for _, h in times[k, v]) * 1e3, 3)
            cell[f"k{k}_{v}_steps"] = len(times[k, v])
        cell["tokens_per_verify"] = round(emitted / verify_rows, 3)
        for v in versions:
            cell[f"spec_over_plain_{v}"] = round(cell[f"k3_{v}_ms"] / cell[f"k0_{v}_ms"], 3)
        prompts, params = workload(name, 1)
        for k, v in runs:
            for key, count in op_counts(versions[v], built[v][k], prompts, params).items():
                cell[f"k{k}_{v}_{key}"] = count
        cell["profile"] = {f"k{k}_{v}": profile(versions[v], built[v][k], prompts, params, args.top) for k, v in runs}
        result["models"][name] = cell
        print(name, json.dumps({key: val for key, val in cell.items() if key != "profile"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
