"""The simulator's figures: the results page's section "The simulator" and the README's 235B projection.

Validation (a) and the 235B projection are computed: their source is the command the page names, and reading them
runs the simulator's own functions (or the command itself). The paper's stage times and speed-ups are the inputs
the simulator holds as data (`sim/reference.py`), read from there. The main job's comparisons read the records the
page cites and price them with the simulator's main-job functions, as `tests/sim/test_main_job.py` does."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from functools import lru_cache

from .base import R, README, Figure, Given, load

VALIDATE = "megatron-spec simulate --validate"
PROJECTION = ("megatron-spec simulate --model=qwen3-235b-a22b --gpu=h100 --gpus=128 --prompt-len=1024 "
              "--max-tokens=8192 --tp=2 --pp=8 --ep=8 --gen-tp=8 --gen-gpus=64 --recompute=full --lag=2 --k=5 "
              "--acceptance=4 --online-drafter")
SYNC_PLAIN = ["--lag=0", "--k=0"]
"""What the README's baseline adds to PROJECTION: synchronous plain decoding on the same layout."""

PLAIN_STEP = "research/records/measured_step_tiny_plain.json"
SPEC_STEP = "research/records/measured_step_tiny_spec.json"
WHOLE_STEP = "research/records/main_job_whole_step.json"
TRADEOFF = "research/records/drafter_cost_tradeoff.json"
PROFILE = "research/records/drafter_cost_profile.json"
GEN_SHARE = "research/records/main_job_gen_share.json"
REGIME_PROFILE = "research/records/drafter_cost_profile_regime.json"
REGIME_RUNS = "research/records/main_job_regime_freshness.json"


# ---- Validation (a): the reference paper's speculative columns, predicted from its autoregressive ones.

@lru_cache(maxsize=None)
def validation(workload: str) -> dict:
    """What `megatron-spec simulate --validate` prints for one workload (`report.validation_report`): the k = 3
    prediction against the paper's, and the k sweep against the paper's."""
    from megatron_spec.sim.reference import (
        PAPER_AR_STAGES, PAPER_GEN_SPEEDUP, PAPER_SPEC_K3, PAPER_TAU, k_sweep, predict_spec_run,
    )

    pred = predict_spec_run(PAPER_AR_STAGES[workload], PAPER_TAU[workload][3], 3)
    paper = PAPER_SPEC_K3[workload]
    return {"gen": [pred.stages["gen"], paper["gen"], 100 * (pred.stages["gen"] / paper["gen"] - 1)],
            "total": [pred.total, paper["total"], 100 * (pred.total / paper["total"] - 1)],
            "sweep": [*k_sweep(workload).values(), *PAPER_GEN_SPEEDUP[workload].values()]}


# ---- The README's 235B projection: the command as printed, against the same with SYNC_PLAIN.

def step_seconds(argv: list[str]) -> float:
    """The simulated step of `megatron-spec simulate ARGV --json`, run in this process."""
    from megatron_spec.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if main([*argv, "--json"]) != 0:
            raise ValueError(f"megatron-spec {' '.join(argv)} failed")
    return json.loads(out.getvalue())["step_s"]


SENSITIVITY = "research/records/projection_235b_sensitivity.json"
"""`simulate --sensitivity` of the projection: the tuner's k and the speed-up at each per-position acceptance."""


def sensitivity_range(r: dict) -> list[float]:
    """The swept per-position acceptances' ends and the speed-up range with the tuner's k (one figure when equal)."""
    rates = sorted(float(p) for p in r["tuner_k"])
    low, high = r["speedup_range_with_tuner_k"]
    return [*([low] if round(low, 2) == round(high, 2) else [low, high]), rates[0], rates[-1]]


def tuner_k_at_assumption(r: dict) -> int:
    """The projection's k, once the tuner picks the same at the assumed per-position acceptance."""
    rate, k = r["assumed"]["per_position"], r["assumed"]["k"]
    picked = next(v for p, v in r["tuner_k"].items() if abs(float(p) - rate) < 1e-5)
    if picked != k:
        raise ValueError(f"the tuner picks k={picked} at the assumption, the projection drafts {k}")
    return k


def fixed_k(r: dict, rate: float) -> list[float]:
    """The assumption's k kept at a per-position acceptance: [k, the speed-up, the acceptance]."""
    k = r["assumed"]["k"]
    row = next(s for s in r["speedups"] if s["per_position"] == rate and s["k"] == k)
    return [k, row["speedup"], rate]


def flag(name: str) -> float:
    """A setting of the projection's command, as it prints it."""
    return float(next(a.split("=", 1)[1] for a in shlex.split(PROJECTION) if a.startswith(f"--{name}=")))


def projection_speedup(acceptance: float | None = None) -> float:
    """The projection's step over synchronous plain decoding's, at the printed acceptance length or another."""
    argv = shlex.split(PROJECTION)[1:]
    if acceptance is not None:
        argv = [a if not a.startswith("--acceptance=") else f"--acceptance={acceptance}" for a in argv]
    return step_seconds(argv + SYNC_PLAIN) / step_seconds(argv)


def lag_alone_speedup() -> float:
    """The projection's policy lag with plain decoding, over synchronous plain decoding (same layout)."""
    argv = shlex.split(PROJECTION)[1:]
    return step_seconds(argv + SYNC_PLAIN) / step_seconds(argv + ["--k=0"])


# ---- The main job against the step model (the CPU host).

def _pairs(record: dict, variant: str, prompts: int = 0) -> list[dict]:
    """Per pair of `variant` in the record, its comparison rows by name (`compare_pair`, as the CLI prints them)."""
    from megatron_spec.sim.main_job import compare_pair, pairs, record_drafter, record_prompts

    prompts = prompts or record_prompts(record)
    return [{r.name: r for r in compare_pair(p, s, prompts=prompts, **record_drafter(record))}
            for p, s in pairs(record) if s["variant"] == variant]


def gated_whole_step(record: dict) -> list[float]:
    """The gated runs' whole step, simulated from the plain partner's rates, then measured inside each run
    (1 / (1 + the gate's cost as a share of the step))."""
    from megatron_spec.sim.main_job import pairs

    gated = [s for _, s in pairs(record) if s["variant"] == "spec"]
    return ([rows["whole_step_ratio"].simulated for rows in _pairs(record, "spec")]
            + [1 / (1 + s["gate_cost_in_run"]) for s in gated])


def forced(record: dict) -> list[float]:
    """k = 3 on every step with the online training: whole step simulated, measured across the two runs."""
    (rows,) = _pairs(record, "online")
    return [rows["whole_step_ratio"].simulated, rows["whole_step_ratio"].measured]


def whole_step_across_pairs(record: dict) -> list[float]:
    rows = _pairs(record, "spec")
    return [r["whole_step_ratio"].simulated for r in rows] + [r["whole_step_ratio"].measured for r in rows]


def _simulated_drafter_over_policy(held: float, minibatches: int, drafts: int = 3) -> float:
    from megatron_spec.sim.main_job import drafter_over_policy, main_job_config

    return drafter_over_policy(main_job_config(30.0, passes=drafts * held, optimizer_steps=round(minibatches * held)))


def tradeoff(record: dict) -> list[list[float]]:
    """Per 50-step run (replay x minibatches, as its name says): the drafter's training over the policy's, within
    the run, simulated and measured."""
    from megatron_spec.sim.main_job import replayed_steps

    out = []
    for name, run in record["runs"].items():
        m = re.match(r"replay (\d+) x (\d+)", name)
        if m:
            replay, minibatches = int(m.group(1)), int(m.group(2))
            sim = _simulated_drafter_over_policy(replayed_steps(run["steps"], replay), minibatches)
            out.append([sim, run["drafter_over_policy_train"]])
    return out


def shipped_profile(record: dict) -> list[float]:
    """The 6-step profile of replay 4 x 8 the CPU's cost per training call was fitted on: measured, simulated."""
    share = record["summary"]["drafter_share_of_train"]
    held = sum(min(i + 1, 4) for i in range(1, record["steps"])) / (record["steps"] - 1)
    return [share / (1 - share), _simulated_drafter_over_policy(held, 8)]


def regime_profiles(record: dict) -> list[float]:
    """The later profiles (minibatches 8, then 2): simulated over measured, minus 1, in percent."""
    out = []
    for minibatches in (8, 2):
        summary = record["profiles"][f"minibatches_{minibatches}"]["summary"]
        held = summary["calls_per_step"]["drafter_backward"] / minibatches
        measured = summary["pieces"]["drafter_total"] / summary["policy_train"]
        out.append(100 * (_simulated_drafter_over_policy(held, minibatches) / measured - 1))
    return out


def regime_run(record: dict) -> float:
    """The later 50-step run with 2 minibatches: simulated over measured, minus 1, in percent."""
    from megatron_spec.sim.main_job import replayed_steps

    run = next(r for r in record["runs"] if r["variant"] == "online_mb2")
    sim = _simulated_drafter_over_policy(replayed_steps(run["steps"], run["replay"]), 2, run["drafts"])
    return 100 * (sim / (run["drafter_s"] / (run["train_s"] - run["drafter_s"])) - 1)


def step_total(record: dict) -> float:
    return sum(record["stages"].values())


FIGURES: list[Figure] = [
    # Validation (a)
    Figure(R, "82.1 / 87.0 s (-5.6 %)", VALIDATE, lambda _: validation("think")["gen"]),
    Figure(R, "133.9 / 137.4 s (-2.5 %)", VALIDATE, lambda _: validation("think")["total"]),
    Figure(R, "1.63 / 1.46 / 1.28 vs 1.53 / 0.84 / 0.71", VALIDATE, lambda _: validation("think")["sweep"]),
    Figure(R, "56.7 / 56.6 s (+0.2 %)", VALIDATE, lambda _: validation("zero")["gen"]),
    Figure(R, "108.0 / 107.5 s (+0.5 %)", VALIDATE, lambda _: validation("zero")["total"]),
    Figure(R, "1.76 / 1.73 / 1.61 vs 1.77 / 1.44 / 1.21", VALIDATE, lambda _: validation("zero")["sweep"]),
    # Validation (b): the measured steps
    Figure(R, "measured step 0.29 s plain", PLAIN_STEP, step_total),
    Figure(R, "0.32 s with MTP k = 3 at acceptance length 2.80", SPEC_STEP,
           lambda r: [step_total(r), r["spec"]["k"], r["spec"]["acceptance_length"]]),
    # The main job's whole step
    Figure(R, "3.50 / 1.35 / 0.51 simulated against 3.98 / 1.30 / 0.51 measured", TRADEOFF,
           lambda r: [s for s, _ in tradeoff(r)] + [m for _, m in tradeoff(r)]),
    Figure(R, "(-12 / +3 / +0.5 %", TRADEOFF, lambda r: [100 * (s / m - 1) for s, m in tradeoff(r)]),
    Figure(R, "3.07 measured, 3.06 simulated", PROFILE, shipped_profile),
    Figure(R, "0.99 / 1.00 / 0.94 simulated against 0.96 / 0.99 / 0.98 measured", WHOLE_STEP, gated_whole_step),
    Figure(R, "0.31x simulated, 0.03x measured", WHOLE_STEP, forced),
    Figure(R, "0.91 / 0.95 / 0.97x simulated against 1.01 / 1.00 / 0.97x measured", GEN_SHARE,
           whole_step_across_pairs),
    Figure(R, "+17 / -11 %", REGIME_PROFILE, regime_profiles),
    Figure(R, "-9 %", REGIME_RUNS, regime_run),
    # README: the 235B recipe, computed
    Figure(README, "at 2.34x over synchronous plain", PROJECTION, lambda _: projection_speedup(),
           where="computed, not measured"),
    Figure(README, "acceptance length of 4 at\nk = 5", PROJECTION, lambda _: [flag("acceptance"), flag("k")],
           where="computed, not measured"),
    Figure(README, "k = 5 (the tuner's k there)", SENSITIVITY, tuner_k_at_assumption, where="computed, not measured"),
    Figure(README, "stays 2.34x for any per-position\nacceptance from 0.5 to 0.9", SENSITIVITY, sensitivity_range,
           where="computed, not measured"),
    Figure(README, "k = 5 kept: 2.06x at 0.5", SENSITIVITY, lambda r: fixed_k(r, 0.5), where="computed, not measured"),
    Figure(README, "async lag 2 alone 1.78x", PROJECTION, lambda _: [flag("lag"), lag_alone_speedup()],
           where="computed, not measured"),
]

GIVEN: list[Given] = []
