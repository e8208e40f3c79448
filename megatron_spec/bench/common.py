"""Shared helpers for benchmarks: the machine's name, timing, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


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


def drafter_checkpoint(target: str, method: str, draft_model: str) -> Path | None:
    """Where the trained drafter for `method` lives: the draft model given, or the head that `train-drafter` saved
    beside the target as `<target>-<method>` (beside `checkpoints/` for a preset name such as smollm2-135m).
    None for the lookup drafters, which have no weights."""
    if method == "draft_model":
        return Path(draft_model)
    if method not in ("mtp", "eagle3"):
        return None
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

    from megatron_spec.models import from_pretrained, load_drafter

    set_threads(threads)
    policy = from_pretrained(MAIN_JOB_POLICY)
    head = load_drafter(MAIN_JOB_DRAFTER, policy.config)
    if checkpoint:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]  # as `load_latest`
        policy.load_state_dict(state["model"])
        head.load_state_dict(state["drafter"])
    return policy, head
