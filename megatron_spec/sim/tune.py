"""Tuner: search parallelism (trainer TP/PP/EP/CP, engine TP/EP and count), colocated vs disaggregated placement,
sync vs async lag, drafter method, k and the adaptive controller for the most tokens trained per second per GPU
(the shortest step on the given GPUs), keeping only configurations that fit in memory and that the trainer and the
Ray placement run (`megatron_spec.layout`: no CP > 1, no colocated engine wider than a node). Every configuration left out
is counted under the reason it was left out (`TuneResult.rejected`), so the table says why the rest lost.

The search factorises the way the step does: the training side (data + logprob + train) depends only on the
trainer layout and its GPU count, generation only on the engine layout, the engine count, k and the controller.
So each training layout and each generation variant is simulated once per GPU share and the two are combined
with `pipeline.compose`, instead of simulating the full product.

For k other than the one the user measured, acceptance follows the drafter's per-position profile where one is
given (`--per-position`: the first k positions of it, for every k it covers), else the constant per-token model:
the per-token rate is solved from the given acceptance length and re-expanded as (1 - a^(k+1)) / (1 - a)
(acceptance.py).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field, replace

from megatron_spec.layout import Layout, check_layout, colocation_problems, suggest_split
from megatron_spec.models.config import ModelConfig

from .acceptance import tau_from_rate
from .config import GenParallel, SimConfig, Speculation, TrainParallel, Workload
from .hardware import Hardware
from .memory import check_fit, memory_report
from .pipeline import StepResult, build, compose, generation, rank_key
from ..drafters.registry import sim_names
from .shapes import CostShape
from .stages import data_time, logprob_time, prepare_time, train_time


@dataclass(frozen=True)
class TuneSpace:
    gen_tp: tuple[int, ...] = (1, 2, 4, 8)
    """Engine tensor-parallel sizes to try (MoE engines also try EP = TP)."""
    train_tp: tuple[int, ...] = (1, 2, 4, 8)
    """Trainer tensor-parallel sizes."""
    train_pp: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Pipeline stages."""
    train_cp: tuple[int, ...] = (1, 2)
    """Context-parallel sizes."""
    train_ep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Expert-parallel sizes (MoE only)."""
    gen_fractions: tuple[float, ...] = (0.25, 0.375, 0.5, 0.625, 0.75)
    """Shares of the GPUs given to generation in disaggregated placements (used when a lag > 0 is allowed)."""
    lags: tuple[int, ...] = (0,)
    """Policy lags allowed (0 = synchronous colocated; > 0 = asynchronous disaggregated)."""
    ks: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 7)
    """Speculative tokens to try (0 = autoregressive)."""
    adaptive: tuple[int | str, ...] = ("off", "auto", 64)
    """Controllers: 'off' (fixed k), 'auto' (best k' <= k at each point), or a sequences-in-flight threshold."""
    methods: tuple[str, ...] = ()
    """Drafter kinds to try (eagle3, mtp, model, ngram) at the base's acceptance; empty: the base's drafter only."""


@dataclass(frozen=True)
class Candidate:
    cfg: SimConfig = field(repr=False)
    """The configuration."""
    result: StepResult = field(repr=False)
    """Its simulated step."""

    @property
    def throughput(self) -> float:
        return self.result.throughput

    def settings(self) -> dict:
        """Flat settings a recipe can read: layouts, placement, lag, k and controller."""
        c, s = self.cfg, self.cfg.spec
        return {
            "train_tp": c.train.tp, "train_pp": c.train.pp, "train_cp": c.train.cp, "train_ep": c.train.ep,
            "train_dp": c.train.dp, "moe_dispatcher": c.moe_dispatcher, "gen_tp": c.gen.tp, "gen_ep": c.gen.ep, "engines": c.engines,
            "colocated": c.colocated, "gen_gpus": c.gen_gpus, "policy_lag": c.policy_lag,
            "method": s.drafter if s else "none", "k": s.k if s else 0, "adaptive": bool(s and s.adaptive),
            "adaptive_threshold": s.adaptive_threshold if s else 0,
            "tokens_per_s_per_gpu": self.throughput, "step_s": self.result.step_s,
        }


class Rejections(Counter):
    """Configurations left out, counted per reason (numbers in the reason replaced by #, one example kept)."""

    def __init__(self):
        super().__init__()
        self.example: dict[str, str] = {}

    def add(self, reason: str, n: int = 1) -> None:
        if n <= 0:
            return
        if reason.count("(") > reason.count(")"):  # a clause cut at its first ";" inside a parenthesis
            reason = reason[: reason.rfind("(")].rstrip()
        key = re.sub(r"\d+(\.\d+)?", "#", reason)
        self[key] += n
        self.example.setdefault(key, reason)


@dataclass
class TuneResult:
    ranked: list[Candidate]
    """Every configuration that fits, best first (`tune` returns the top of it)."""
    rejected: Rejections
    """Configurations left out, per reason."""


def _train_layouts(base: SimConfig, space: TuneSpace, train_gpus: int, rejected: Rejections):
    m = base.model_config
    eps = space.train_ep if m.is_moe else (1,)
    for tp, pp, cp, ep in itertools.product(space.train_tp, space.train_pp, space.train_cp, eps):
        if train_gpus % (tp * pp * cp):
            rejected.add(f"train tp*pp*cp={tp * pp * cp} does not divide the {train_gpus} training GPUs")
            continue
        # Sequence parallelism goes with TP > 1: the simulator's activation memory assumes it (split over TP), and
        # Megatron-Core needs it to train MoE layers under TP.
        layout = replace(TrainParallel(tp=tp, pp=pp, cp=cp, ep=ep, dp=train_gpus // (tp * pp * cp)),
                         sequence_parallel=tp > 1)
        first, last = suggest_split(m.num_hidden_layers, pp) if pp <= m.num_hidden_layers else (None, None)
        problems = replace(layout, first_stage_layers=first, last_stage_layers=last).problems(
            m, train_gpus, runnable=True, who="train")
        if problems:  # what the trainer does not run first: never chosen, grouped by the reason counted
            rejected.add(problems[0].split(";")[0])
            continue
        yield layout


def _spec_variants(space: TuneSpace, spec: Speculation | None):
    yield None
    if spec is None:
        return
    rate = spec.rate
    for method, k in itertools.product(space.methods or (spec.drafter,), space.ks):
        if k == 0:
            continue
        # A drafter's own per-position profile prices every k it covers (its acceptance decays with depth as
        # measured); past it, or from one acceptance length, the constant per-token rate.
        profile = spec.per_position[:k] if k <= len(spec.per_position) else ()
        tau = 0.0 if profile else tau_from_rate(rate, k)
        for mode in space.adaptive:
            yield replace(spec, drafter=method, k=k, acceptance_length=tau, per_position=profile,
                          adaptive=mode != "off", adaptive_threshold=mode if isinstance(mode, int) else 0)


def _placements(base: SimConfig, space: TuneSpace):
    if 0 in space.lags:
        yield 0, base.gpus, True
    for lag in (x for x in space.lags if x > 0):
        for frac in space.gen_fractions:
            gen_gpus = int(round(base.gpus * frac))
            if 0 < gen_gpus < base.gpus:
                yield lag, gen_gpus, False


def search(base: SimConfig, space: TuneSpace = TuneSpace()) -> TuneResult:
    """Every configuration around `base` (its model, hardware, GPU count, workload and acceptance) that fits,
    highest tokens trained per second per GPU first, and the reasons the others were left out. For each placement
    only the fastest training layout of its GPU share is kept (the training side does not depend on the engines);
    the others are counted as slower."""
    for method in space.methods:
        if method not in sim_names():
            raise ValueError(f"unknown drafter method {method!r}: known are {', '.join(sim_names())}")
    if space.methods and base.spec is None:
        raise ValueError("trying drafter methods needs an acceptance to assume: give the base a Speculation")
    hw, cal, target, _ = build(base)
    best: list[Candidate] = []
    rejected = Rejections()
    for lag, gen_gpus, colocated in _placements(base, space):
        train_gpus = base.gpus if colocated else base.gpus - gen_gpus
        sides = []
        for layout in _train_layouts(base, space, train_gpus, rejected):
            cfg = replace(base, train=layout, gen=GenParallel(), colocated=colocated, policy_lag=lag,
                          gen_gpus=0 if colocated else gen_gpus, spec=None)
            if not fits_train(cfg, hw, target):
                rejected.add("trainer does not fit in memory")
                continue
            sides.append((data_time(cfg, cal) + logprob_time(cfg, hw, cal, target)
                          + train_time(cfg, hw, cal, target, None), layout))
        if not sides:
            continue
        sides.sort(key=lambda s: s[0])
        rejected.add("a slower training layout for the same GPU share", len(sides) - 1)
        for gtp, spec in itertools.product(space.gen_tp, _spec_variants(space, base.spec)):
            geps = {1, gtp} if base.model_config.is_moe else {1}
            unplaceable = colocation_problems(colocated, gtp)  # the Ray placement's rule: never chosen, counted
            if unplaceable:
                rejected.add(unplaceable[0], len(geps))
                continue
            for gep in geps:
                cand = _evaluate(base, sides[0][1], GenParallel(tp=gtp, ep=gep), colocated, gen_gpus, lag, spec,
                                 rejected)
                if cand is not None:
                    best.append(cand)
    best.sort(key=lambda c: rank_key(c.result.step_s, c.result.stages["gen"], c.settings()["k"]))
    ranked = _distinct(best)
    rejected.add("a larger k the controller never uses (same step as a smaller one)", len(best) - len(ranked))
    return TuneResult(ranked, rejected)


def tune(base: SimConfig, space: TuneSpace = TuneSpace(), top: int = 10) -> list[Candidate]:
    """Best configurations around `base`, highest tokens trained per second per GPU first."""
    result = search(base, space)
    if not result.ranked:
        hint = "" if any(lag > 0 for lag in space.lags) else " (a policy lag > 0 adds disaggregated placements)"
        raise ValueError(f"no configuration of {base.model} on {base.gpus} {base.hardware} fits in memory and "
                         f"runs{hint}: " + format_rejections(result.rejected))
    return result.ranked[:top]


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that only differ from a better-ranked one by a larger k the controller never uses."""
    seen, out = set(), []
    for c in cands:
        s = c.settings()
        key = tuple(v for name, v in s.items() if name != "k") + (round(c.result.stages["gen"], 9),)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def fits_train(cfg: SimConfig, hw: Hardware, target: CostShape) -> bool:
    """Memory check of the training side only (generation is checked per engine variant)."""
    rep = memory_report(cfg, hw, target, None)
    return rep.train_total <= rep.device_bytes


def cheaper_dispatcher(base: SimConfig, layout: Layout) -> str:
    """The MoE dispatcher that moves fewer bytes at this EP: allgather sends each token to the ep - 1 other EP
    ranks, alltoall its top-k copies to (ep - 1) / ep of them, so allgather wins while ep < top_k."""
    return "allgather" if layout.ep < base.model_config.num_experts_per_tok else "alltoall"


def _evaluate(base: SimConfig, layout: Layout, gen: Layout, colocated: bool, gen_gpus: int, lag: int,
              spec: Speculation | None, rejected: Rejections) -> Candidate | None:
    try:
        cfg = replace(base, train=layout, gen=gen, colocated=colocated, gen_gpus=0 if colocated else gen_gpus,
                      policy_lag=lag, spec=spec, moe_dispatcher=cheaper_dispatcher(base, layout))
    except ValueError as err:  # this engine layout does not divide the model or the GPU share
        rejected.add(str(err).split(";")[0])
        return None
    hw, cal, target, drafter = build(cfg)
    mem = memory_report(cfg, hw, target, drafter)
    try:
        check_fit(cfg, mem)
        gen_res = generation(cfg, hw, cal, target, drafter, mem, steps_in_flight=max(lag, 1))
    except ValueError as err:
        rejected.add(str(err).split(":")[0])
        return None
    gen_side = gen_res.time_s / max(lag, 1)
    stages = {"data": data_time(cfg, cal), "prepare": prepare_time(cfg, hw, cal, target, drafter), "gen": gen_side,
              "logprob": logprob_time(cfg, hw, cal, target), "train": train_time(cfg, hw, cal, target, drafter)}
    step, exposed = compose(cfg, stages, gen_side)
    w: Workload = cfg.workload
    res = StepResult(stages=stages, step_s=step, exposed_gen_s=exposed, tokens_per_step=w.rollouts *
                     w.tokens_per_rollout, gpus=cfg.gpus, gen=gen_res, memory=mem,
                     gen_tokens=w.rollouts * w.response.expected)
    return Candidate(cfg, res)


def recipe_defaults(base: SimConfig, space: TuneSpace = TuneSpace()) -> dict:
    """The tuner's best settings for a recipe to start from."""
    return tune(base, space, top=1)[0].settings()


@dataclass(frozen=True)
class TunedLayout:
    """The tuner's best configuration in the terms a recipe sets (`RLConfig.backend` and `spec`)."""

    layout: Layout
    """The whole layout: the trainer's split (Megatron-Core's uneven first / last stages, sequence parallelism with
    TP > 1, data-parallel replicas), one engine's split, the engine count and the placement."""
    async_lag: int
    """Policy lag (`backend.async_lag`; 0 = synchronous)."""
    method: str
    """Drafter kind (eagle3, mtp, model, ngram) or none."""
    k: int
    """Speculative tokens (0 = plain decoding)."""
    adaptive: bool
    """Whether the adaptive controller may lower k."""
    moe_dispatcher: str = "alltoall"
    """The trainer's MoE token dispatcher the ranking assumed (`cheaper_dispatcher`)."""

    @property
    def train(self) -> Layout:
        """The trainer's split (the whole layout; `describe` names the trainer's part)."""
        return self.layout

    @property
    def train_dp(self) -> int:
        return self.layout.dp

    @property
    def gen_tp(self) -> int:
        return self.layout.engine.tp

    @property
    def gen_ep(self) -> int:
        return self.layout.engine.ep

    @property
    def engines(self) -> int:
        return self.layout.engines

    @property
    def gen_gpus(self) -> int:
        return self.layout.engines * self.layout.engine.tp

    @property
    def placement(self) -> str:
        return "colocated" if self.layout.colocated else "disaggregated"

    def backend_overrides(self) -> dict[str, object]:
        """Dotted `RLConfig` overrides of the backend section: the layout's (`Layout.overrides`), the policy lag and
        the MoE dispatcher the ranking assumed."""
        return {**self.layout.overrides(), "backend.async_lag": self.async_lag,
                "backend.megatron.moe_token_dispatcher": self.moe_dispatcher}


def best_layout(model: str | ModelConfig, gpus: int, gpu: str = "h100", workload: Workload | None = None,
                spec: Speculation | None = None, space: TuneSpace = TuneSpace(),
                **config) -> tuple[TunedLayout, dict[str, float]]:
    """The best layout for `model` on `gpus` GPUs of kind `gpu` and its predicted stage times (seconds, under the
    RL loop's stage names, plus `step`). `workload` defaults to the projection's (4096 rollouts, a 16k cap);
    `spec` is the speculation to assume (method and acceptance; None: plain decoding only); `config` passes other
    `SimConfig` fields (gen_dtype_bytes, gpu_memory_utilization, ...). The layout is checked again here with what
    this project runs (`Layout.problems`)."""
    if workload is None:
        from .projection import projection_workload

        workload = projection_workload()
    base = SimConfig(model=model, hardware=gpu, gpus=gpus, workload=workload, train=TrainParallel(dp=gpus),
                     spec=spec, **config)
    best = tune(base, space, top=1)[0]
    c, s = best.cfg, best.cfg.spec
    check_layout(c.model_config, c.layout, world=c.train_gpus, who="tuned train", runnable=True)
    tuned = TunedLayout(layout=c.layout, async_lag=c.policy_lag, method=s.drafter if s else "none",
                        k=s.k if s else 0, adaptive=bool(s and s.adaptive), moe_dispatcher=c.moe_dispatcher)
    return tuned, {**best.result.stages, "step": best.result.step_s}


def format_rejections(rejected: Rejections) -> str:
    """One line per reason, most frequent first: count, then an example."""
    if not rejected:
        return "nothing was left out"
    return "\n".join(f"{n:6d} x {rejected.example[key]}" for key, n in rejected.most_common())


def format_table(cands: list[Candidate]) -> str:
    cols = ("rank", "tok/s/gpu", "step_s", "gen_s", "train", "gen", "place", "lag", "method", "k", "ctrl")
    lines = [f"{cols[0]:>4} {cols[1]:>10} {cols[2]:>7} {cols[3]:>7} {cols[4]:>16} {cols[5]:>12} "
             f"{cols[6]:>10} {cols[7]:>3} {cols[8]:>6} {cols[9]:>2} {cols[10]:>6}"]
    for i, c in enumerate(cands, 1):
        s = c.settings()
        train = f"tp{s['train_tp']}pp{s['train_pp']}cp{s['train_cp']}ep{s['train_ep']}dp{s['train_dp']}"
        place = "coloc" if s["colocated"] else f"{s['gen_gpus']}gen"
        gen = f"{s['engines']}x tp{s['gen_tp']}ep{s['gen_ep']}"
        ctrl = "off" if not s["adaptive"] else (str(s["adaptive_threshold"]) if s["adaptive_threshold"] else "auto")
        lines.append(f"{i:4d} {c.throughput:10.1f} {c.result.step_s:7.1f} {c.result.stages['gen']:7.1f} "
                     f"{train:>16} {gen:>12} {place:>10} {s['policy_lag']:3d} {s['method']:>6} "
                     f"{s['k']:2d} {ctrl:>6}")
    return "\n".join(lines)


def _label(c: Candidate) -> str:
    s = c.settings()
    place = "coloc" if s["colocated"] else f"{s['gen_gpus']}g L{s['policy_lag']}"
    ctrl = "" if not s["adaptive"] else (f" <={s['adaptive_threshold']}" if s["adaptive_threshold"] else " auto")
    return f"k{s['k']}{ctrl}\ngen tp{s['gen_tp']}\n{place}"


def plot(cands: list[Candidate], path: str) -> str:
    """Throughput of the top configurations, and their step time against each side's time; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_label(c) for c in cands]
    x = list(range(len(cands)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(cands)) * 1.6, 4.5))
    ax1.bar(x, [c.throughput for c in cands], color="tab:blue")
    ax1.set_ylabel("tokens trained / s / GPU")
    ax1.set_title("top configurations (best first)")
    width = 0.27
    step = [c.result.step_s for c in cands]
    gen = [c.result.stages["gen"] for c in cands]
    train = [sum(c.result.stages[s] for s in ("data", "logprob", "train")) for c in cands]
    ax2.bar([i - width for i in x], step, width, label="step")
    ax2.bar(x, gen, width, label="gen (per step)")
    ax2.bar([i + width for i in x], train, width, label="data+logprob+train")
    ax2.set_ylabel("seconds")
    ax2.set_title("step vs generation and training sides")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
