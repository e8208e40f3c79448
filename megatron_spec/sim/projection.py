"""Projection: Qwen3-235B-A22B GRPO on H100 and GB200 clusters, sync and async, with and without speculation.

The reference paper projects ~2.5x end to end for async (lag 2) + speculation (k=5, acceptance 4) on 2048 GB200
with a rollout batch of 4096 and FP8 rollouts, from a simulator it does not publish. Here the same question goes
through our step model with its per-GPU calibration. The H100 figures are the trusted ones: the Hopper set is
fitted on NeMo-RL's published H100 step times and checked on others, every row within 15 % (`published.py`,
docs/design/simulator-calibration.md). The GB200 figures use the spec-sheet Blackwell set, which NeMo-RL's
published GB200 rows (0.2-0.75 of their step times) show to be optimistic for the software those rows ran.

- workload: 4096 rollouts per step (256 prompts x 16), FP8 engine weights, and the response-length distribution
  inferred from the paper's RL-Think AR run (validation (a)), so lengths are not a free knob; `spread` varies its
  log-normal sigma at the same mean;
- training layout: the 235B recipe's (recipes/qwen3_235b_grpo_spec.py), TP2 PP8 EP16 without context
  parallelism, data parallel over the rest, full activation recomputation as NeMo-RL's 235B recipe runs it, one
  optimizer step per RL step and no reference pass (the recipe has no KL term);
- engines: TP8 with the experts spread over the same 8 GPUs (EP8) -- 29 GB of FP8 weights per GPU;
- sync runs are colocated on all GPUs (offloading trainer states and engine weights each step); async runs are
  disaggregated, with the generation / training split that gives each variant (AR or speculative) its own best
  step time, so speculation is not handicapped by a split chosen for AR.

Speedups are against synchronous autoregressive generation on the same number of GPUs. Beside the paper's k=5,
`tuned_run` gives each point at the k the tuner would pick for the same drafter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from .acceptance import tau_from_rate
from .config import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload
from .pipeline import StepResult, rank_key, simulate
from .reference import PAPER_AR_STAGES, ReferenceSetup, infer_mean_length

MODEL = "qwen3-235b-a22b"
TRAIN_TP, TRAIN_PP, TRAIN_CP, TRAIN_EP = 2, 8, 1, 16
GEN_TP = 8
GEN_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


@lru_cache(maxsize=1)
def projection_workload() -> Workload:
    """4096 rollouts with the RL-Think length distribution inferred from the paper's 8B AR gen time."""
    setup = ReferenceSetup()
    mean = infer_mean_length(setup, PAPER_AR_STAGES["think"]["gen"])
    return Workload(prompts_per_step=256, group_size=16, prompt_len=setup.prompt_len,
                    response=LengthDist(mean=mean, max_tokens=setup.max_tokens, sigma=setup.sigma))


def projection_config(hardware: str, gpus: int, lag: int = 0, spec: Speculation | None = None,
                      gen_gpus: int = 0, workload: Workload | None = None) -> SimConfig:
    """The 235B configuration: colocated when lag == 0, else disaggregated with `gen_gpus` generating."""
    train_gpus = gpus if lag == 0 else gpus - gen_gpus
    per_replica = TRAIN_TP * TRAIN_PP * TRAIN_CP
    train = TrainParallel(tp=TRAIN_TP, pp=TRAIN_PP, cp=TRAIN_CP, ep=TRAIN_EP, dp=max(train_gpus // per_replica, 1))
    return SimConfig(model=MODEL, hardware=hardware, gpus=gpus, workload=workload or projection_workload(),
                     train=train, gen=GenParallel(tp=GEN_TP, ep=GEN_TP), colocated=lag == 0,
                     gen_gpus=0 if lag == 0 else gen_gpus, spec=spec, policy_lag=lag, gen_dtype_bytes=1,
                     recompute="full")


def best_async(hardware: str, gpus: int, lag: int, spec: Speculation | None,
               workload: Workload | None = None) -> tuple[SimConfig, StepResult]:
    """The disaggregated split (from GEN_FRACTIONS, training GPUs a multiple of one EP-complete replica set)
    with the shortest step."""
    dp_unit = TRAIN_EP // math.gcd(TRAIN_EP, TRAIN_CP * TRAIN_TP)  # ep must divide dp*cp*tp
    unit = TRAIN_TP * TRAIN_PP * TRAIN_CP * dp_unit
    best = None
    for frac in GEN_FRACTIONS:
        train_gpus = round(gpus * (1 - frac) / unit) * unit
        if not 0 < train_gpus < gpus:
            continue
        cfg = projection_config(hardware, gpus, lag, spec, gpus - train_gpus, workload)
        try:
            res = simulate(cfg)
        except ValueError:
            continue  # this split does not fit in memory
        if best is None or res.step_s < best[1].step_s:
            best = (cfg, res)
    if best is None:
        raise ValueError(f"no generation/training split of {gpus} {hardware} GPUs fits Qwen3-235B-A22B")
    return best


@dataclass(frozen=True)
class ProjectionRow:
    hardware: str
    """GPU profile."""
    gpus: int
    """GPUs in the job."""
    lag: int
    """Policy lag (0 = synchronous, colocated)."""
    k: int
    """Speculative tokens (0 = autoregressive)."""
    tau: float
    """Acceptance length (1 when autoregressive)."""
    gen_gpus: int
    """GPUs generating (all of them when colocated)."""
    gen_s: float
    """Generation seconds per step as the generation side runs it."""
    step_s: float
    """Seconds per RL step."""
    exposed_gen_s: float
    """Generation the training side waits for."""
    rollout_speedup: float
    """Sync AR gen seconds / this gen seconds (same GPU count)."""
    e2e_speedup: float
    """Sync AR step seconds / this step seconds (same GPU count)."""


def run(hardware: str, gpus: int, lag: int, k: int = 0, tau: float = 1.0,
        workload: Workload | None = None) -> ProjectionRow:
    """One projection point, with its speedups against sync AR on the same GPUs; speculation drafts with an
    EAGLE-3 head trained online (one pass over the step's rows and one optimizer step, in `train`)."""
    spec = Speculation(k=k, acceptance_length=tau, online_drafter_training=True) if k else None
    base = simulate(projection_config(hardware, gpus, 0, None, workload=workload))
    if lag == 0:
        cfg = projection_config(hardware, gpus, 0, spec, workload=workload)
        res = simulate(cfg)
    else:
        cfg, res = best_async(hardware, gpus, lag, spec, workload)
    return ProjectionRow(hardware, gpus, lag, k, tau if k else 1.0, cfg.gen_gpus, res.stages["gen"], res.step_s,
                         res.exposed_gen_s, base.stages["gen"] / res.stages["gen"], base.step_s / res.step_s)


def headline(hardwares: tuple[str, ...] = ("h100", "gb200")) -> list[ProjectionRow]:
    """The paper's two projected points (sync on 512 GPUs, async lag 2 on 2048) with and without speculation
    at k=5, acceptance 4, on each hardware."""
    rows = []
    for hw in hardwares:
        for gpus, lag in ((512, 0), (2048, 2)):
            rows.append(run(hw, gpus, lag))
            rows.append(run(hw, gpus, lag, k=5, tau=4.0))
    return rows


def tuned_run(hardware: str, gpus: int, lag: int, rate: float, ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7),
              workload: Workload | None = None) -> ProjectionRow:
    """The point at the k the tuner picks for a drafter of per-token acceptance `rate` (the acceptance length at
    each k from the constant-rate model, as `tune.search` expands it): the shortest step, then the shortest
    generation, then the smaller k."""
    rows = [run(hardware, gpus, lag, k=k, tau=tau_from_rate(rate, k), workload=workload) for k in ks]
    return min(rows, key=lambda r: rank_key(r.step_s, r.gen_s, r.k))


def sensitivity(hardware: str = "h100", gpus: int = 2048, taus: tuple[float, ...] = (2.0, 3.0, 4.0, 5.0),
                lags: tuple[int, ...] = (0, 1, 2, 4), k: int = 5) -> dict[tuple[int, float], float]:
    """End-to-end speedup against sync AR for each (policy lag, acceptance length) at k; tau 1 means no
    speculation."""
    out = {}
    for lag in lags:
        out[(lag, 1.0)] = run(hardware, gpus, lag).e2e_speedup
        for tau in taus:
            out[(lag, tau)] = run(hardware, gpus, lag, k=k, tau=tau).e2e_speedup
    return out


def format_rows(rows: list[ProjectionRow]) -> str:
    head = f"{'hw':6} {'gpus':>5} {'lag':>3} {'k':>2} {'tau':>4} {'gen_gpus':>8} {'gen_s':>7} {'step_s':>7} " \
           f"{'exposed':>7} {'rollout_x':>9} {'e2e_x':>6}"
    lines = [head]
    for r in rows:
        lines.append(f"{r.hardware:6} {r.gpus:5d} {r.lag:3d} {r.k:2d} {r.tau:4.1f} {r.gen_gpus:8d} {r.gen_s:7.1f} "
                     f"{r.step_s:7.1f} {r.exposed_gen_s:7.1f} {r.rollout_speedup:9.2f} {r.e2e_speedup:6.2f}")
    return "\n".join(lines)


def spread_workload(sigma: float) -> Workload:
    """The projection's workload with response-length spread `sigma` at the same mean before the cap."""
    w = projection_workload()
    return replace(w, response=LengthDist(mean=w.response.mean, max_tokens=w.response.max_tokens, sigma=sigma))


def spread_sensitivity(hardware: str = "h100", sigmas: tuple[float, ...] = (0.4, 0.8, 1.2),
                       points: tuple[tuple[int, int], ...] = ((512, 0), (2048, 2)), k: int = 5,
                       tau: float = 4.0) -> dict[tuple[int, int, float], tuple[float, float]]:
    """(AR, speculative) end-to-end speedup against sync AR on the same GPUs and spread, for each (GPUs, lag)
    point and response-length spread sigma: a longer tail leaves more small-batch decode for speculation."""
    out = {}
    for gpus, lag in points:
        for sigma in sigmas:
            w = spread_workload(sigma)
            out[(gpus, lag, sigma)] = (run(hardware, gpus, lag, workload=w).e2e_speedup,
                                       run(hardware, gpus, lag, k=k, tau=tau, workload=w).e2e_speedup)
    return out


SENSITIVITY_RATES = (0.5, 0.6, 0.7, 0.8, 0.9)
SENSITIVITY_KS = (1, 2, 3, 4, 5, 6, 7)


@dataclass(frozen=True)
class Sensitivity:
    """A configuration's whole-step speed-up over synchronous plain decoding on its own layout, for every
    per-position acceptance (the same at each draft position) and k: how far a projection rests on its acceptance
    assumption, and which k the tuner would pick at each acceptance."""

    speedups: dict[tuple[float, int], float]
    """(per-position acceptance, k) -> plain synchronous step / this step."""
    gen_s: dict[tuple[float, int], float]
    """(per-position acceptance, k) -> the generation side's seconds per step (the tuner's tie-break)."""
    assumed: tuple[float, int, float]
    """The configuration's own (per-position acceptance equivalent to its acceptance length, k, speed-up)."""
    plain_s: float
    """The plain synchronous step's seconds, which every speed-up divides."""

    def best_k(self, rate: float) -> int:
        """The k the tuner picks at this acceptance (`tune.search`'s order): the shortest step, then, where
        training bounds the step and several k tie, the shortest generation, then the smaller k."""
        return min((k for r, k in self.speedups if r == rate),
                   key=lambda k: rank_key(self.plain_s / self.speedups[(rate, k)], self.gen_s[(rate, k)], k))

    def speedup_range(self) -> tuple[float, float]:
        """Lowest and highest speed-up over the sweep with the tuner's k at each acceptance."""
        picked = [self.speedups[(r, self.best_k(r))] for r in sorted({r for r, _ in self.speedups})]
        return min(picked), max(picked)


def acceptance_sensitivity(cfg: SimConfig, rates: tuple[float, ...] = SENSITIVITY_RATES,
                           ks: tuple[int, ...] = SENSITIVITY_KS) -> Sensitivity:
    """Re-simulate `cfg` (which speculates) at each per-position acceptance and k, against the same layout run
    synchronously without speculation. The configuration's own acceptance is swept over `ks` too, so `best_k`
    answers for the assumption itself."""
    if cfg.spec is None:
        raise ValueError("the acceptance sensitivity needs a speculative configuration (--k and --acceptance)")
    plain = simulate(replace(cfg, spec=None, policy_lag=0)).step_s
    speedups, gen_s = {}, {}
    for rate in (*rates, cfg.spec.rate):
        for k in ks:
            spec = replace(cfg.spec, k=k, acceptance_length=0.0, per_position=(rate,) * k, adaptive=False)
            res = simulate(replace(cfg, spec=spec))
            speedups[(rate, k)], gen_s[(rate, k)] = plain / res.step_s, res.stages["gen"]
    return Sensitivity(speedups, gen_s, (cfg.spec.rate, cfg.spec.k, plain / simulate(cfg).step_s), plain)


def format_sensitivity(s: Sensitivity) -> str:
    own, k, speedup = s.assumed
    rates = sorted({r for r, _ in s.speedups if r != own})
    ks = sorted({kk for _, kk in s.speedups})
    low, high = s.speedup_range()
    lines = [f"whole-step speed-up over synchronous plain decoding on the same layout, by per-position acceptance "
             f"(rows) and k (columns); the configuration's own: {speedup:.2f}x at k={k}, per-position acceptance "
             f"{own:.3f} (acceptance length {sum(own ** i for i in range(k + 1)):.2f})",
             "accept " + " ".join(f"{'k=' + str(kk):>6}" for kk in ks) + "  tuner's k"]
    for r in (*rates, own):
        lines.append(f"{r:6.3g} " + " ".join(f"{s.speedups[(r, kk)]:6.2f}" for kk in ks) + f"  {s.best_k(r):9d}"
                     + ("  (assumed)" if r == own else ""))
    lines.append(f"the tuner's k at the assumed acceptance: {s.best_k(own)} "
                 f"({s.speedups[(own, s.best_k(own))]:.2f}x); over per-position acceptance {rates[0]:g}-{rates[-1]:g} "
                 f"with the tuner's k: {low:.2f}-{high:.2f}x")
    return "\n".join(lines)
