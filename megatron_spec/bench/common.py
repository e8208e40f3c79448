"""Shared helpers for benchmarks: the machine's name, timing, tables and JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from ..speculative.adaptive import octave


def machine(device: str = "cpu") -> str:
    """A one-line description of where a benchmark ran: the GPU for a `cuda` device, else the CPU model, vector ISA
    and threads (also on a machine that has a GPU the benchmark did not use)."""
    import torch

    if device.startswith("cuda"):
        return f"GPU {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # The vector ISA torch runs on (AVX2, AVX512, ...): the same CPU model name has come with either here, and
    # the engine's GEMM paths and its kernels' code differ between them.
    isa = torch.backends.cpu.get_cpu_capability()
    return f"CPU {cpu} ({isa}), {torch.get_num_threads()} threads (torch {torch.__version__})"


def set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Best wall time of `repeats` calls (best-of filters noise from other processes) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path


def emit(record: dict, out: str | os.PathLike | None) -> dict:
    """A benchmark's record printed, and the same text written to `out` when given (its JSON record); returns it."""
    text = json.dumps(record, indent=2)
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return record


def drafter_checkpoint(target: str, method: str, draft_model: str) -> Path | None:
    """Where the trained drafter for `method` lives: the draft model given, or the head that `train-drafter` saved
    beside the target as `<target>-<method>` (beside `checkpoints/` for a preset name such as smollm2-135m).
    None for the lookup drafters, which have no weights."""
    from megatron_spec.drafters.registry import drafter_method

    if not drafter_method(method).needs_weights:
        return None
    if drafter_method(method).standalone:  # a whole model, given by its own flag, `--draft-model`
        return Path(draft_model)
    target = Path(target)
    parent = target.parent if target.exists() else Path("checkpoints")
    return parent / f"{target.name}-{method}"


MAIN_JOB_POLICY, MAIN_JOB_DRAFTER = "checkpoints/tiny-qwen3-deep-careful", "checkpoints/tiny-qwen3-deep-careful-mtp"
"""The main job's shipped policy and MTP head (`recipes/tiny_grpo_spec.py`), from the repository root."""


def main_job_models(threads: int | None, checkpoint: str | None = None):
    """(policy, MTP head) of the main job, loaded on the CPU with torch at `threads` threads (None: as it is), for
    the benchmarks that time its rollouts: the shipped pair, or the policy and drafter a main-job `checkpoint`
    (a run's `state.pt`) holds."""
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.files import load_drafter

    set_threads(threads)
    policy = from_pretrained(MAIN_JOB_POLICY)
    head = load_drafter(MAIN_JOB_DRAFTER, policy.config)
    if checkpoint:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]  # as `load_latest`
        policy.load_state_dict(state["model"])
        head.load_state_dict(state["drafter"])
    return policy, head


def main_job_parser(description: str) -> argparse.ArgumentParser:
    """The arguments the in-process benchmarks on the main job's rollouts share: `--checkpoint`, `--rounds`,
    `--threads`, `--out`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--checkpoint", default=None, help="a main-job state.pt whose policy and drafter to load")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p


def main_job_record(benchmark: str, args: argparse.Namespace, **fields) -> dict:
    """The record of an in-process benchmark on the main job's rollouts (`main_job_parser`'s `args`): what ran, on
    what, then `fields`; printed, and written to `args.out` where given."""
    result = {"benchmark": benchmark, "machine": machine(), "target": MAIN_JOB_POLICY, "drafter": MAIN_JOB_DRAFTER,
              "checkpoint": args.checkpoint, "rollout": "8 prompts x 8 samples, T=1, max 160 tokens, EOS stops",
              "rounds": args.rounds, **fields}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def alternating_rounds(runs: dict, rounds: int, prompts: int = 8, samples: int = 8, max_tokens: int = 160,
                       ignore_eos: bool = False):
    """Rounds of the main job's rollout shape (`prompts` x `samples` rollouts, T = 1, new prompts and seed each
    round), every engine of `runs` once a round, the order reversing each round so that no engine always runs
    first on a host whose speed drifts. Round 0 is the untimed warm-up. Yields (round, {name: seconds}) after
    each round, round 0 included, so a caller can set up its timers between rounds."""
    from megatron_spec.engine import SamplingParams
    from megatron_spec.rl.train_drafter import task_prompts

    names = list(runs)
    for r in range(rounds + 1):
        batch = [q for q in task_prompts(MAIN_JOB_POLICY, prompts, seed=100 + r) for _ in range(samples)]
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=r, ignore_eos=ignore_eos)
        seconds = {}
        for name in names if r % 2 else names[::-1]:
            start = time.perf_counter()
            runs[name].generate(batch, params)
            seconds[name] = time.perf_counter() - start
        yield r, seconds


def record_choices(controller, chosen: list, expected: bool = False) -> None:
    """Append (batch, k) to `chosen` for each k the adaptive `controller` chooses from now on (0: plain decoding);
    with `expected`, (batch, k, E_k): the tokens a sequence it expected of that k when it chose, at the acceptance of
    the batch's octave (a few microseconds a step more, so only where that is measured)."""
    choose = controller.choose_k

    def recorded(batch: int) -> int:
        k = choose(batch)
        if expected:
            accept = controller.acceptance(controller.octaves[octave(batch)])
            chosen.append((batch, k, controller.expected_tokens(accept)[k]))
        else:
            chosen.append((batch, k))
        return k

    controller.choose_k = recorded


STEP_PARTS = ("propose", "verify", "accept")


def time_step_parts(engine, steps: list) -> None:
    """Append (batch size, or None for a prefill step; seconds; {part: seconds} for STEP_PARTS; tokens emitted) to
    `steps` for each of the engine's steps: drafting (`propose`), the target's `verify` forward and `accept`."""
    parts: dict = {}

    def wrap(owner, name):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            parts[name] = time.perf_counter() - t0
            if name == "accept":
                parts["tokens"] = sum(len(tokens) for tokens, _ in out)
            return out

        setattr(owner, name, timed)

    wrap(engine, "propose")
    wrap(engine, "accept")
    start, step = engine.start, engine.step

    def started(*args, **kwargs):
        seqs = start(*args, **kwargs)
        wrap(engine.runner, "verify")  # the runner is made per generate call
        return seqs

    def stepped():
        parts.clear()
        batch = len(engine.scheduler.running)
        t0 = time.perf_counter()
        step()
        decode = "propose" in parts  # a prefill step proposes nothing
        steps.append((batch if decode else None, time.perf_counter() - t0,
                      {p: parts.get(p, 0.0) for p in STEP_PARTS}, parts["tokens"]))

    engine.start, engine.step = started, stepped
