"""NeMo-RL's published GRPO step times as simulator inputs, and the table that compares the two.

`data/nemo_rl_published.json` holds each row as its release's performance summary and recipe YAML give it (model,
GPUs, placement, layouts, batch, sequence lengths, vLLM memory share, recompute) with its source, plus the rows the
simulator cannot express and why. Every row runs with NeMo-RL's settings that the tables share: a reference-policy
log-prob pass (KL penalty 0.01), colocated offload, in-flight weight updates when asynchronous, sequence packing at the recipe's micro-batch tokens, and 512
sequences per optimizer step. Responses follow a log-normal under the cap whose mean after truncation is the
table's average length less the prompt (`response_for`); the prompt length and spread are the file's stated
assumptions.

    megatron-spec simulate --compare-published
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .config import GenParallel, LengthDist, SimConfig, TrainParallel, Workload
from .pipeline import STAGES, StepResult, simulate
from .calibration import Calibration
from .hardware import Hardware

PROMPT_LEN = 150
SIGMA = 0.8


@lru_cache(maxsize=1)
def published() -> dict:
    """The data file: 'rows', 'models' (HF config dicts of models without a preset), 'not_expressible'."""
    return json.loads(resources.files("megatron_spec.sim").joinpath("data/nemo_rl_published.json").read_text())


def rows(hardware: str = "h100", precision: str = "bf16") -> list[dict]:
    """The published rows of one GPU profile (h100 or gb200) and precision (bf16, or fp8 for generation and
    training in FP8)."""
    return [r for r in published()["rows"]
            if r["hardware"] == hardware and r.get("precision", "bf16") == precision]


def row(name: str, hardware: str = "h100", precision: str = "bf16") -> dict:
    for r in rows(hardware, precision):
        if r["name"] == name:
            return r
    raise ValueError(f"no published {hardware} row {name!r}: known are {', '.join(r['name'] for r in rows(hardware))}")


def response_for(avg_seq_len: float, max_seq_len: int, prompt_len: int = PROMPT_LEN,
                 sigma: float = SIGMA) -> LengthDist:
    """The log-normal response lengths, capped at `max_seq_len - prompt_len`, whose mean after the cap is
    `avg_seq_len - prompt_len` (bisection on the body's mean: the capped mean grows with it)."""
    cap = max_seq_len - prompt_len
    target = avg_seq_len - prompt_len
    if not 0 < target < cap:
        raise ValueError(f"average length {avg_seq_len} must lie between the prompt ({prompt_len}) and the cap "
                         f"({max_seq_len})")
    lo, hi = 1.0, 4.0 * cap
    if LengthDist(mean=hi, max_tokens=cap, sigma=sigma).expected < target:
        raise ValueError(f"no body reaches a capped mean of {target} under a cap of {cap} at sigma {sigma}")
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if LengthDist(mean=mid, max_tokens=cap, sigma=sigma).expected < target else (lo, mid)
    return LengthDist(mean=(lo + hi) / 2, max_tokens=cap, sigma=sigma)


def config_for(r: dict, hardware: str | Hardware | None = None, sigma: float = SIGMA, **overrides) -> SimConfig:
    """The simulator's configuration of one published row (`overrides` replace SimConfig fields)."""
    model = published()["models"].get(r["model"], r["model"])
    colocated = not r["gen_gpus"]
    train_gpus = r["gpus"] - r["gen_gpus"]
    t = r["train"]
    train = TrainParallel(tp=t["tp"], pp=t["pp"], ep=t["ep"], cp=t["cp"],
                          dp=train_gpus // (t["tp"] * t["pp"] * t["cp"]))
    workload = Workload(prompts_per_step=r["prompts"], group_size=r["generations"], prompt_len=PROMPT_LEN,
                        response=response_for(r["avg_seq_len"], r["max_seq_len"], sigma=sigma))
    kwargs = dict(model=model, hardware=hardware or r["hardware"], gpus=r["gpus"], workload=workload, train=train,
                  gen=GenParallel(tp=r["gen_tp"]), colocated=colocated, gen_gpus=r["gen_gpus"],
                  policy_lag=r["lag"], gpu_memory_utilization=r["gpu_memory_utilization"],
                  micro_batch_tokens=r["train_mb_tokens"], recompute=r["recompute"],
                  train_global_batch=r["train_global_batch"], reference_logprob=True,
                  in_flight_updates=bool(r["lag"]))
    if r.get("precision") == "fp8":
        kwargs.update(train_fp8=True, gen_dtype_bytes=1)
    kwargs.update(overrides)
    return SimConfig(**kwargs)


@dataclass(frozen=True)
class Comparison:
    name: str
    """Row name."""
    release: str
    """NeMo-RL release whose table gives the row."""
    published_s: float
    """Published step time, seconds."""
    result: StepResult
    """The simulated step."""

    @property
    def ratio(self) -> float:
        """Simulated over published step time."""
        return self.result.step_s / self.published_s


def compare(names: list[str] | None = None, cal: Calibration | None = None, hardware: str = "h100",
            precision: str = "bf16", **overrides) -> list[Comparison]:
    """Simulate the published rows of `hardware` and `precision` (all, or `names`) with calibration `cal`
    (default: the GPU's set)."""
    out = []
    for r in rows(hardware, precision):
        if names is None or r["name"] in names:
            res = simulate(config_for(r, **overrides), cal=cal)
            out.append(Comparison(r["name"], r["release"], r["step_s"], res))
    return out


def format_table(comps: list[Comparison], footer: bool = True, fitted: tuple[str, ...] = ()) -> str:
    """One line per row: published and simulated step seconds, their ratio and the simulated stage parts; rows in
    `fitted` are marked 'fit', the others 'check'."""
    head = f"{'row':22} {'use':5} {'release':7} {'published':>9} {'simulated':>9} {'ratio':>6}  " + " ".join(
        f"{s:>7}" for s in STAGES) + f" {'exposed':>7}"
    lines = [head]
    for c in comps:
        st = c.result.stages
        use = "fit" if c.name in fitted else "check"
        lines.append(f"{c.name:22} {use:5} {c.release:7} {c.published_s:9.1f} {c.result.step_s:9.1f} {c.ratio:6.2f}  "
                     + " ".join(f"{st[s]:7.1f}" for s in STAGES) + f" {c.result.exposed_gen_s:7.1f}")
    if fitted:
        lines.append("")
        for label, part in (("fitted", [c for c in comps if c.name in fitted]),
                            ("held out", [c for c in comps if c.name not in fitted])):
            if part:
                worst = max(part, key=lambda c: abs(c.ratio - 1))
                lines.append(f"{label} ({len(part)} rows): ratio {min(c.ratio for c in part):.2f}-"
                             f"{max(c.ratio for c in part):.2f}, furthest {worst.name} ({worst.ratio - 1:+.0%}); "
                             f"{sum(abs(c.ratio - 1) <= 0.15 for c in part)} of {len(part)} within 15 %")
    if not footer:
        return "\n".join(lines)
    lines.append("")
    lines.append("not expressible:")
    for n in published()["not_expressible"]:
        lines.append(f"  {n['rows']} ({n['release']}): {n['reason']}")
    return "\n".join(lines)
