"""One RL step end to end: the five stages, composed synchronously or asynchronously.

Synchronous (policy_lag 0), colocated or not: the stages run one after the other,

    step = data + prepare + gen + logprob + train.

Asynchronous with policy lag L >= 1 (disaggregated: generation GPUs and training GPUs are different): generation
of step t+L runs while step t trains, and the two sides meet at each refit,

    step = max(gen side, data + logprob + train) + prepare,

where the gen side is the time to generate one step's rollouts when the engine is fed L steps at once. With L = 1
each step still drains the batch (its long tail is exposed unless training is longer); with L >= 2 the next step's
sequences fill the tail of the current one, so the engine runs at a full batch -- which is also where speculation
pays least. Exposed generation is what the training side waits for: step - (data + logprob + train + prepare).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace as _replace

from .calibration import Calibration, calibration_for
from .config import SimConfig
from .generation import Engine, GenResult, simulate_generation
from .hardware import Hardware, hardware
from .memory import MemoryReport, check_fit, memory_report
from .shapes import CostShape, drafter_shape, shape_of
from .stages import (
    data_time, drafter_train_time, logprob_time, prepare_time, refit_link, refit_time, train_time,
)

STAGES = ("data", "prepare", "gen", "logprob", "train")


@dataclass
class StepResult:
    stages: dict[str, float]
    """Seconds per stage, under the names the RL loop times (gen: one step's rollouts, as the step sees it)."""
    step_s: float
    """Seconds per RL step (the period in asynchronous runs)."""
    exposed_gen_s: float
    """Generation time the training side waits for (all of gen when synchronous)."""
    tokens_per_step: float
    """Prompt + response tokens trained per step."""
    gpus: int
    """Devices in the job."""
    gen_tokens: float = 0.0
    """Response tokens generated per step."""
    gen: GenResult = field(repr=False, default_factory=GenResult)
    """Per-engine generation details (steps, batch, preemptions, trace)."""
    memory: MemoryReport | None = field(repr=False, default=None)
    """Per-GPU memory of trainer and engine."""
    drafter_train_s: float = 0.0
    """Of `stages['train']`, the online drafter's training (0 when it is frozen or there is none)."""
    refit_transport: str = ""
    """How the refit in `prepare` moves the weights (`stages.refit_link`), and whether its figure is measured or
    from a spec sheet."""
    refit_s: float = 0.0
    """Of `stages['prepare']`, the refit's transfer."""
    plain: "StepResult | None" = field(repr=False, default=None)
    """The same configuration without speculation (`simulate(..., with_plain=True)`), for the ratios below."""

    @property
    def gen_ratio(self) -> float | None:
        """Plain gen stage over this one's: the gen-stage speedup of speculation (None without `plain`)."""
        return self.plain.stages["gen"] / self.stages["gen"] if self.plain else None

    @property
    def whole_step_ratio(self) -> float | None:
        """Plain step over this one's, the drafter's online training included: what speculation gives the run."""
        return self.plain.step_s / self.step_s if self.plain else None

    @property
    def throughput(self) -> float:
        """Tokens trained per second per GPU: the tuner's objective."""
        return self.tokens_per_step / self.step_s / self.gpus

    @property
    def rollout_tokens_per_s(self) -> float:
        """Generated tokens per second over the whole job during gen."""
        return self.gen_tokens / self.stages["gen"] if self.stages["gen"] else 0.0


def build(cfg: SimConfig, hw: Hardware | None = None, cal: Calibration | None = None
          ) -> tuple[Hardware, Calibration, CostShape, CostShape | None]:
    """Resolve hardware, calibration (the GPU's own set unless `cal` is given) and cost shapes of a configuration."""
    hw = hw or hardware(cfg.hardware)
    cal = cal or calibration_for(hw.name)
    if cfg.decode_eff is not None:
        cal = _replace(cal, decode_eff=cfg.decode_eff)
    kv_bytes = 4 if cfg.gen_dtype_bytes == 4 else 2
    target = shape_of(cfg.model_config, name=str(cfg.model), kv_dtype_bytes=kv_bytes)
    drafter = None
    if cfg.spec is not None:
        s = cfg.spec
        drafter = drafter_shape(cfg.model_config, s.drafter, s.draft_model, s.drafter_layers, s.draft_vocab, kv_bytes)
    return hw, cal, target, drafter


def generation(cfg: SimConfig, hw: Hardware, cal: Calibration, target: CostShape, drafter: CostShape | None,
               mem: MemoryReport, steps_in_flight: int = 1) -> GenResult:
    """Simulate one engine generating `steps_in_flight` steps' worth of its share of the rollouts."""
    engine = Engine(target, drafter, hw, cal, cfg.gen.tp, cfg.gen.ep, cfg.gen_dtype_bytes,
                    mem.kv_capacity_tokens, cfg.max_num_seqs)
    w = cfg.workload
    n = w.rollouts / cfg.engines * steps_in_flight
    return simulate_generation(engine, n, w.prompt_len, w.response.quantiles(), cfg.spec,
                               prompt_share=w.group_size)


def compose(cfg: SimConfig, stages: dict[str, float], gen_side_s: float) -> tuple[float, float]:
    """(step seconds, exposed generation seconds) from stage times; `gen_side_s` is gen per step as the
    generation side runs it (equal to stages['gen'] when synchronous)."""
    train_side = stages["data"] + stages["logprob"] + stages["train"]
    if cfg.policy_lag == 0:
        return sum(stages.values()), stages["gen"]
    step = max(gen_side_s, train_side) + stages["prepare"]
    return step, max(0.0, gen_side_s - train_side)


def simulate(cfg: SimConfig, hw: Hardware | None = None, cal: Calibration | None = None,
             with_plain: bool = False) -> StepResult:
    """Predict one RL step of `cfg` (with calibration `cal`, default the hardware's set); raises ValueError if it
    does not fit in memory. `with_plain` also simulates the same step without speculation (`StepResult.plain`), so
    the result carries the gen-stage and whole-step ratios."""
    hw, cal, target, drafter = build(cfg, hw, cal)
    mem = memory_report(cfg, hw, target, drafter)
    check_fit(cfg, mem)
    n = cfg.steps_in_flight
    gen = generation(cfg, hw, cal, target, drafter, mem, steps_in_flight=n)
    gen_side = gen.time_s / n
    stages = {
        "data": data_time(cfg, cal),
        "prepare": prepare_time(cfg, hw, cal, target, drafter, mem),
        "gen": gen_side,
        "logprob": logprob_time(cfg, hw, cal, target, mem),
        "train": train_time(cfg, hw, cal, target, drafter),
    }
    step, exposed = compose(cfg, stages, gen_side)
    w = cfg.workload
    plain = simulate(_replace(cfg, spec=None), hw, cal) if with_plain and cfg.spec is not None else None
    return StepResult(stages=stages, step_s=step, exposed_gen_s=exposed,
                      tokens_per_step=w.rollouts * w.tokens_per_rollout, gpus=cfg.gpus, gen=gen, memory=mem,
                      gen_tokens=w.rollouts * w.response.expected,
                      drafter_train_s=drafter_train_time(cfg, hw, cal, drafter),
                      refit_transport=refit_link(cfg, hw, cal)[0],
                      refit_s=refit_time(cfg, hw, cal, target, drafter), plain=plain)


def rank_key(step_s: float, gen_s: float, k: int) -> tuple:
    """The tuner's order, lowest first: the shortest step (the most tokens trained per second, since every candidate
    trains the same tokens on the same GPUs), then, where training bounds the step and several tie, the shortest
    generation, then the smaller k. Seconds are compared to the microsecond, so float noise never decides a tie."""
    return round(step_s, 6), round(gen_s, 6), k
