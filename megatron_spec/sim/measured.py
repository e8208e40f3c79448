"""Validation case (b): predict the embedded engine's measured stage times (`megatron-spec bench step` on this CPU).

The measurement file (benchmarks/results/bench_step_cpu.json) follows

    {"machine": str, "model": preset name,
     "workload": {"prompts_per_step": int, "group_size": int, "prompt_len": int,
                  "response": {"mean": float, "max_tokens": int, "sigma": float}},
     "stages": {"data": s, "prepare": s, "gen": s, "logprob": s, "train": s},
     "spec": {"k": int, "acceptance_length": float, "drafter": str, "draft_model": str} or null,
     "threads": int (optional, default 2)}

and the prediction is `pipeline.simulate` on the CPU profile (one device, colocated, float32) with the same
workload and speculation: no constant is touched per file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import LengthDist, SimConfig, Speculation, Workload
from .cpu_profile import DEFAULT_THREADS, load_or_measure
from .pipeline import STAGES, simulate

DEFAULT_MEASUREMENT = Path("benchmarks/results/bench_step_cpu.json")
TOLERANCE = 0.15  # relative, for stages long enough to time (>= MIN_STAGE_S)
MIN_STAGE_S = 0.05  # shorter stages are dominated by timer noise and Python overhead; compared in absolute terms


def _workload(raw: dict) -> Workload:
    resp = raw.get("response") or {}
    response = LengthDist(
        mean=float(resp.get("mean", raw.get("mean_response_len", 0))),
        max_tokens=int(resp.get("max_tokens", raw.get("max_new_tokens", 0))),
        sigma=float(resp.get("sigma", raw.get("sigma", 0.8))),
    )
    return Workload(prompts_per_step=int(raw["prompts_per_step"]), group_size=int(raw["group_size"]),
                    prompt_len=int(raw["prompt_len"]), response=response)


def config_from_measurement(data: dict, cpu_profile: str | None = None) -> SimConfig:
    """The SimConfig a measurement file describes (CPU, one device, FP32)."""
    for key in ("model", "workload", "stages"):
        if key not in data:
            raise ValueError(f"measurement file lacks {key!r} (see megatron_spec/sim/measured.py for the schema)")
    spec_raw = data.get("spec") or None
    spec = None
    if spec_raw and int(spec_raw.get("k", 0)) > 0:
        spec = Speculation(k=int(spec_raw["k"]), acceptance_length=float(spec_raw["acceptance_length"]),
                           drafter=spec_raw.get("drafter", "model"), draft_model=spec_raw.get("draft_model", ""))
    workload = _workload(data["workload"])
    return SimConfig(model=data["model"], hardware="cpu", gpus=1, workload=workload, spec=spec, gen_dtype_bytes=4,
                     max_num_seqs=workload.rollouts, cpu_profile=cpu_profile or "")


@dataclass(frozen=True)
class StageComparison:
    stage: str
    """Stage name."""
    measured_s: float
    """Measured seconds."""
    predicted_s: float
    """Predicted seconds."""

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else 0.0

    @property
    def ok(self) -> bool:
        if self.measured_s < MIN_STAGE_S:
            return abs(self.predicted_s - self.measured_s) < MIN_STAGE_S
        return abs(self.rel_error) <= TOLERANCE


def compare(path: str | Path = DEFAULT_MEASUREMENT, cpu_profile: str | None = None) -> list[StageComparison]:
    """Prediction vs measurement for each stage of a bench-step result file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no measurement file at {path} (run `megatron-spec bench step` to write one)")
    data = json.loads(path.read_text())
    load_or_measure(cpu_profile, threads=int(data.get("threads", DEFAULT_THREADS)))
    result = simulate(config_from_measurement(data, cpu_profile))
    measured = data["stages"]
    return [StageComparison(s, float(measured[s]), result.stages[s]) for s in STAGES if s in measured]


def format_comparison(rows: list[StageComparison]) -> str:
    lines = [f"{'stage':8} {'measured_s':>10} {'predicted_s':>11} {'error':>7}  ok"]
    for r in rows:
        lines.append(f"{r.stage:8} {r.measured_s:10.3f} {r.predicted_s:11.3f} {100 * r.rel_error:6.1f}%  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)
