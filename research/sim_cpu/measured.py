"""Validation case (b): predict the embedded engine's measured stage times (`megatron-spec bench step` on this CPU).

The measurement file (research/records/bench_step_cpu.json) follows

    {"machine": str, "model": preset name,
     "workload": {"prompts_per_step": int, "group_size": int, "prompt_len": int,
                  "response": {"mean": float, "max_tokens": int, "sigma": float}},
     "stages": {"data": s, "prepare": s, "gen": s, "logprob": s, "train": s},
     "spec": {"k": int, "acceptance_length": float, "drafter": str, "draft_model": str,
              "online": bool (optional, default false: the drafter trained during the run)} or null,
     "trainer": {"micro_batch_tokens": int, "fold_logprob": bool, "share_prompt": bool} (optional),
     "threads": int (optional, default 2)}

and the prediction is `pipeline.simulate` on the CPU profile (one device, colocated, float32) with the same
workload, speculation and trainer settings: no constant is touched per file. `trainer` is how the embedded trainer
ran (`grpo.micro_batch_tokens`, `grpo.fold_logprob`, `grpo.share_prompt`); a file without it (or without a field)
was measured before the trainer had that, so it reads as one padded batch (0), a separate recompute forward and
unshared prompts (false). `response.sigma` is fitted by `bench step` to the runs' mean and longest response
(`LengthDist.fit`, which it records as `measured_mean` and `measured_longest`); files written before that carry a
fixed 0.3.

The deterministic form of this check (research/tests/sim_cpu/test_measured.py) predicts the committed measurements
(research/records/measured_step_tiny_{plain,spec}.json) with the CPU profile measured on this machine and
committed beside them (research/records/sim_cpu_profile.json), so it needs no timing at test time. Stages shorter
than `MIN_STAGE_S` (`data`, a quarter of a millisecond of prompt encoding, and `prepare`, a millisecond of refit
through Python per tensor) are compared in absolute terms: at that size they are host bookkeeping the model does
not describe, and they move the step total by under 1 %.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_spec.sim.config import LengthDist, SimConfig, Speculation, Workload  # noqa: F401 (SimConfig: hints)
from megatron_spec.sim.pipeline import STAGES

from .cpu_profile import DEFAULT_THREADS, CpuProfile, load_or_measure
from .hardware import CpuHardware
from .model import cpu_config, simulate

DEFAULT_MEASUREMENT = Path("research/records/bench_step_cpu.json")
COMMITTED_MEASUREMENTS = (Path("research/records/measured_step_tiny_plain.json"),
                          Path("research/records/measured_step_tiny_spec.json"))
COMMITTED_PROFILE = Path("research/records/sim_cpu_profile.json")
CURRENT_TRAINER = Path("research/records/validation_b_2026-11-23")
"""A later pair: `bench step --steps 6 --drafters mtp` with the trainer's defaults of 2026-11-23 (1024-token
micro-batches, folded recompute, shared prompts; MTP trained online) in `measured_{plain,spec}.json`, and the CPU
profile calibrated right after it in `cpu_profile.json` (with `train_op_s` and `train_work`)."""
TOLERANCE = 0.15  # relative, for stages long enough to time (>= MIN_STAGE_S) and for the step total
MIN_STAGE_S = 0.01  # shorter stages are host bookkeeping the model does not describe; compared in absolute terms
OLD_TRAINER = {"micro_batch_tokens": 0, "fold_logprob": False, "share_prompt": False}
"""How a measurement file without a `trainer` block (or a field of it) ran: one padded batch, a separate recompute
forward and every prompt once per rollout (the embedded trainer before micro-batching, the fold and prompt
sharing)."""


def _workload(raw: dict) -> Workload:
    resp = raw.get("response") or {}
    response = LengthDist(
        mean=float(resp.get("mean", raw.get("mean_response_len", 0))),
        max_tokens=int(resp.get("max_tokens", raw.get("max_new_tokens", 0))),
        sigma=float(resp.get("sigma", raw.get("sigma", 0.8))),
    )
    return Workload(prompts_per_step=int(raw["prompts_per_step"]), group_size=int(raw["group_size"]),
                    prompt_len=int(raw["prompt_len"]), response=response)


def config_from_measurement(data: dict, hw: CpuHardware) -> SimConfig:
    """The SimConfig a measurement file describes (this CPU as `hw`, one device, FP32)."""
    for key in ("model", "workload", "stages"):
        if key not in data:
            raise ValueError(f"measurement file lacks {key!r} (see research/sim_cpu/measured.py for the schema)")
    spec_raw = data.get("spec") or None
    spec = None
    if spec_raw and int(spec_raw.get("k", 0)) > 0:
        spec = Speculation(k=int(spec_raw["k"]), acceptance_length=float(spec_raw["acceptance_length"]),
                           drafter=spec_raw.get("drafter", "model"), draft_model=spec_raw.get("draft_model", ""),
                           online_drafter_training=bool(spec_raw.get("online", False)))
    workload = _workload(data["workload"])
    trainer = data.get("trainer") or OLD_TRAINER
    return cpu_config(data["model"], hw, workload, spec, max_num_seqs=workload.rollouts,
                      micro_batch_tokens=int(trainer.get("micro_batch_tokens", OLD_TRAINER["micro_batch_tokens"])),
                      fold_logprob=bool(trainer.get("fold_logprob", OLD_TRAINER["fold_logprob"])),
                      share_prompt=bool(trainer.get("share_prompt", OLD_TRAINER["share_prompt"])))


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


def profile_for(data: dict, cpu_profile: str | Path | None = None) -> CpuProfile:
    """The CPU profile to predict `data` with: a stored file as it is (it must have the measurement's thread
    count: a committed profile is never re-measured behind the caller's back), or the cached one, measured with
    the measurement's threads if missing."""
    threads = int(data.get("threads", DEFAULT_THREADS))
    if cpu_profile and Path(cpu_profile).is_file():
        profile = CpuProfile.load(cpu_profile)
        if profile.threads != threads:
            raise ValueError(f"CPU profile {cpu_profile} was measured with {profile.threads} threads, the "
                             f"measurement ran {threads}: re-measure it with "
                             f"`python -m research.sim_cpu calibrate --threads {threads}`")
        return profile
    return load_or_measure(cpu_profile, threads=threads)


def compare(path: str | Path = DEFAULT_MEASUREMENT, cpu_profile: str | Path | None = None,
            roofline_only: bool = False) -> list[StageComparison]:
    """Prediction vs measurement for each stage of a bench-step result file, and for the step total.
    `roofline_only` drops the per-operator and per-sequence costs (what the model was before it had them)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no measurement file at {path} (run `megatron-spec bench step` to write one)")
    data = json.loads(path.read_text())
    profile = profile_for(data, cpu_profile)
    if roofline_only:
        profile = profile.without_overheads()
    result = simulate(config_from_measurement(data, profile.to_hardware()))
    measured = data["stages"]
    rows = [StageComparison(s, float(measured[s]), result.stages[s]) for s in STAGES if s in measured]
    rows.append(StageComparison("total", sum(r.measured_s for r in rows), sum(r.predicted_s for r in rows)))
    return rows


def format_comparison(rows: list[StageComparison]) -> str:
    lines = [f"{'stage':8} {'measured_s':>10} {'predicted_s':>11} {'error':>7}  ok"]
    for r in rows:
        verdict = "yes" if r.ok else "NO"
        if r.measured_s < MIN_STAGE_S:
            verdict += f" (under {1e3 * MIN_STAGE_S:.0f} ms: compared in absolute terms)"
        lines.append(f"{r.stage:8} {r.measured_s:10.4f} {r.predicted_s:11.4f} {100 * r.rel_error:6.1f}%  {verdict}")
    return "\n".join(lines)
