"""The step model against a measured main job on the CPU host: gen, the online drafter's training (over the
policy's own and in seconds) and the gen-stage and whole-step ratios of a speculative run against a plain one.

The main job (the tiny deep Qwen3, up to 160 tokens, an MTP head drafting k = 3 and trained online on its three
chained drafts, over the states of the trained groups and of `extra_groups` more, replayed or not) runs on a shared
2-core host whose load moves a run's speed by several times between runs minutes apart. So the prediction takes
its host rates from the plain run it is compared with, and predicts the speculative run from them:

- gen: the plain run's seconds per generated token, times the simulated ratio of a speculative gen stage to a
  plain one on the CPU host (`simulate(..., with_plain=True)` at the run's acceptance length), on the steps that
  speculated; steps the whole-step gate ran plainly cost what plain ones do;
- drafter training: the policy's training per step, times the simulated drafter-to-policy training ratio
  (`stages.drafter_train_time` over `stages.policy_train_time`: FLOPs at the drafter's and the policy's sizes over
  the same rows, and the drafter's AdamW steps and training calls), with the replay holding as many steps as the
  run had trained on (`replayed_steps`: steps the gate ran plainly add nothing to it), on the steps that trained it;
  checked within the speculative run itself (its own policy training sets the rate), where the host's load
  cancels;
- whole step: (plain gen + plain train) / (predicted gen + plain train + predicted drafter training), per step.

Only ratios of the step model are used, so the host's absolute speed cancels; what load does to one run and not the
other does not, and shows as error in the figures taken across the two runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..drafters.registry import DEFAULT_METHOD, drafter_method
from .calibration import Calibration
from .config import LengthDist, SimConfig, Speculation, TrainParallel, Workload
from .pipeline import build, simulate
from .stages import drafter_train_time, policy_train_time

MAIN_JOB_MODEL = "tiny-qwen3-deep"
"""Preset with the main job's policy shape (96 wide, 8 layers, 64-token vocabulary)."""
MAIN_JOB_PROMPTS, MAIN_JOB_GROUP, MAIN_JOB_MAX_TOKENS = 8, 8, 160
"""Prompts per step (the records that do not say ran 8), rollouts per prompt, response cap."""
TRAINED_GROUPS = 8
"""Groups the drafter-to-policy training ratio is taken over. The policy and the drafter train on the same rows, so
their number enters the ratio only through the drafter's cost per training call against the policy's pass; the
records do not keep how many groups each step trained (the earlier main job trained those with an advantage, the
current one the first 4 of them), and `CPU_HOST.train_call_s` was fitted with 8 (all of that job's groups), so the
ratio is taken at 8 whatever the run generated."""
MAIN_JOB_PROMPT_LEN = 16
"""BOS and an addition chain of 2-8 terms: about 16 tokens."""
MAIN_JOB_SIGMA = 0.5
"""Spread of the response lengths: a step's longest answer is about 3x its mean (e.g. mean 28, longest 82)."""
MAIN_JOB_DRAFTS, MAIN_JOB_REPLAY, MAIN_JOB_MINIBATCHES, MAIN_JOB_EXTRA_GROUPS = 3, 1, 8, 20
"""The shipped online training (`drafter_train`: drafts, replay, minibatches, extra_groups; one update); a record's
own `drafter_train` (`record_drafter`) overrides it."""
MAIN_JOB_TRAIN_GROUPS = 4
"""Groups the main job's policy trains a step (`grpo.train_groups`)."""


def drafter_rows(extra_groups: int) -> float:
    """The drafter's rows over the policy's: the trained groups and `extra_groups` more, over the trained ones."""
    return (MAIN_JOB_TRAIN_GROUPS + extra_groups) / MAIN_JOB_TRAIN_GROUPS


MAIN_JOB_DRAFTER_PASSES = MAIN_JOB_DRAFTS * MAIN_JOB_REPLAY * drafter_rows(MAIN_JOB_EXTRA_GROUPS)
"""Passes of the MTP layer over the policy's trained rows per RL step once the replay is full (its own rows being
the trained groups and the extra ones)."""
MAIN_JOB_DRAFTER_OPTIMIZER_STEPS = MAIN_JOB_REPLAY * MAIN_JOB_MINIBATCHES


def replayed_steps(trained_steps: int, replay: int = MAIN_JOB_REPLAY) -> float:
    """Mean steps the replay holds over a run's first `trained_steps` drafter updates: it fills one trained step
    at a time (1, 2, ... up to `replay`), so a run that trained the drafter on a few steps only (a gated run)
    trained it on fewer than `replay` steps each time."""
    if trained_steps < 1:
        return 0.0
    return sum(min(i, replay) for i in range(1, trained_steps + 1)) / trained_steps


def main_job_config(mean_len: float, k: int = 3, tau: float = 3.5, passes: float = MAIN_JOB_DRAFTER_PASSES,
                    optimizer_steps: int = MAIN_JOB_DRAFTER_OPTIMIZER_STEPS, online: bool = True,
                    prompts: int = MAIN_JOB_PROMPTS) -> SimConfig:
    """The main job on the CPU host: one process, float32, micro-batches of up to 2048 tokens, no recompute, the
    behaviour log-probs folded into the train forward (the embedded trainer's default), MTP drafting `k` at
    acceptance length `tau`, `prompts` x 8 rollouts a step."""
    spec = Speculation(k=k, acceptance_length=tau, drafter=drafter_method(DEFAULT_METHOD).sim_label, online_drafter_training=online,
                       drafter_passes=passes, drafter_optimizer_steps=optimizer_steps)
    workload = Workload(prompts, MAIN_JOB_GROUP, MAIN_JOB_PROMPT_LEN,
                        LengthDist(mean=mean_len, max_tokens=MAIN_JOB_MAX_TOKENS, sigma=MAIN_JOB_SIGMA))
    return SimConfig(model=MAIN_JOB_MODEL, hardware="cpu", gpus=1, workload=workload, train=TrainParallel(),
                     spec=spec, gen_dtype_bytes=4, micro_batch_tokens=2048, recompute="none", offload=False,
                     fold_logprob=True,
                     max_num_seqs=prompts * MAIN_JOB_GROUP)


def drafter_over_policy(cfg: SimConfig, cal: Calibration | None = None) -> float:
    """Simulated online drafter training over the policy's own training, per RL step (with calibration `cal`,
    default the CPU host's)."""
    hw, cal, target, drafter = build(cfg, cal=cal)
    return drafter_train_time(cfg, hw, cal, drafter) / policy_train_time(cfg, hw, cal, target)


@dataclass(frozen=True)
class Row:
    name: str
    measured: float
    simulated: float

    @property
    def error(self) -> float:
        """simulated / measured - 1."""
        return self.simulated / self.measured - 1 if self.measured else float("nan")


def _mean_tau(run: dict) -> float:
    taus = [t for t in run.get("tau_curve") or [] if t]
    if not taus:
        raise ValueError(f"run {run.get('variant')!r} seed {run.get('seed')} has no acceptance length: it never "
                         "speculated, so there is nothing to compare")
    return sum(taus) / len(taus)


def compare_pair(plain: dict, spec: dict, k: int = 3, drafts: int = MAIN_JOB_DRAFTS, replay: int = MAIN_JOB_REPLAY,
                 minibatches: int = MAIN_JOB_MINIBATCHES, prompts: int = MAIN_JOB_PROMPTS,
                 extra_groups: int = 0) -> list[Row]:
    """Per-step figures of a speculative main-job run against the step model (two runs of a main-job record:
    `steps`, `gen_s`, `train_s`, `drafter_s`, `gen_tokens`, `tau_curve` and, for a gated run, `steps_gated_plain`,
    `steps_drafter_trained` and `steps_drafter_cut`; a `frozen` variant's drafter only measures, without training).

    `drafter_over_policy` and `drafter_train_s` are within the speculative run (its own policy training sets the
    rate, so the host's load cancels); `gen_s`, `gen_ratio` and `whole_step_ratio` take the plain run's rates, so
    they carry whatever load moved between the two runs."""
    for run in (plain, spec):
        missing = [key for key in ("steps", "gen_s", "train_s", "gen_tokens") if run.get(key) is None]
        if missing or not run["steps"]:
            raise ValueError(f"run {run.get('variant')!r} lacks {missing or ['steps']}")
    n_plain, n_spec = plain["steps"], spec["steps"]
    mean_len = spec["gen_tokens"] / n_spec / (prompts * MAIN_JOB_GROUP)
    online = spec.get("variant") != "frozen"
    # A step whose training the gate stopped at its budget did a fraction of it, which its measured seconds hold.
    trained_steps = 0
    if online:
        trained_steps = int(spec.get("steps_drafter_trained", n_spec)) - int(spec.get("steps_drafter_cut") or 0)
    held = replayed_steps(trained_steps, replay) or 1.0
    cfg = main_job_config(mean_len, k, _mean_tau(spec), drafts * held * drafter_rows(extra_groups),
                          max(1, round(minibatches * held)), online=online, prompts=prompts)
    gen_ratio = simulate(cfg, with_plain=True).gen_ratio  # plain gen / speculative gen
    speculated = (n_spec - int(spec.get("steps_gated_plain") or 0)) / n_spec
    trained = trained_steps / n_spec
    ratio = drafter_over_policy(replace(cfg, workload=replace(cfg.workload, prompts_per_step=TRAINED_GROUPS),
                                        max_num_seqs=TRAINED_GROUPS * MAIN_JOB_GROUP))
    measured_drafter = float(spec.get("drafter_s") or 0.0) / n_spec
    spec_policy = spec["train_s"] / n_spec - measured_drafter
    per_token = plain["gen_s"] / plain["gen_tokens"]
    gen = per_token * spec["gen_tokens"] / n_spec * (speculated / gen_ratio + 1 - speculated)
    policy = plain["train_s"] / n_plain
    plain_step = (plain["gen_s"] + plain["train_s"]) / n_plain
    step = gen + policy * (1 + ratio * trained)
    measured_step = (spec["gen_s"] + spec["train_s"]) / n_spec
    rows = [Row("gen_s", spec["gen_s"] / n_spec, gen)]
    if online:
        rows += [Row("drafter_over_policy", measured_drafter / spec_policy, ratio * trained),
                 Row("drafter_train_s", measured_drafter, spec_policy * ratio * trained)]
    return rows + [Row("gen_ratio", per_token / (spec["gen_s"] / spec["gen_tokens"]),
                       per_token * spec["gen_tokens"] / n_spec / gen),
                   Row("whole_step_ratio", plain_step / measured_step, plain_step / step)]


def pairs(record: dict) -> list[tuple[dict, dict]]:
    """(plain, speculative) runs of the same seed in a main-job record, every speculative variant against the plain
    run of its seed."""
    runs = record.get("runs")
    if not isinstance(runs, list):
        raise ValueError("a main-job record has a list of runs (variant, seed, steps, gen_s, train_s, ...)")
    plain = {r["seed"]: r for r in runs if r.get("variant") == "plain"}
    return [(plain[r["seed"]], r) for r in runs if r.get("variant") != "plain" and r.get("seed") in plain
            and any(t for t in r.get("tau_curve") or [])]


def record_prompts(record: dict) -> int:
    """Prompts per step of a main-job record: its `prompts_per_step`, else a `grpo.prompts_per_step=N` override in
    its command, else `MAIN_JOB_PROMPTS` (the records written before the main job generated more)."""
    if record.get("prompts_per_step"):
        return int(record["prompts_per_step"])
    match = re.search(r"grpo\.prompts_per_step=(\d+)", str(record.get("command", "")))
    return int(match.group(1)) if match else MAIN_JOB_PROMPTS


def record_drafter(record: dict) -> dict:
    """The online drafter training a main-job record's runs used (`drafts`, `replay`, `minibatches`,
    `extra_groups`, as `compare_pair` takes them): its `drafter_train`, else the shipped one (a record without
    `extra_groups` predates them: 0)."""
    d = record.get("drafter_train")
    if not d:
        return {"drafts": MAIN_JOB_DRAFTS, "replay": MAIN_JOB_REPLAY, "minibatches": MAIN_JOB_MINIBATCHES,
                "extra_groups": MAIN_JOB_EXTRA_GROUPS}
    return {"drafts": int(d.get("drafts", MAIN_JOB_DRAFTS)), "replay": int(d.get("replay", MAIN_JOB_REPLAY)),
            "minibatches": int(d.get("minibatches", MAIN_JOB_MINIBATCHES)), "extra_groups": int(d.get("extra_groups", 0))}


def format_pairs(record: dict, prompts: int = 0, **kwargs) -> str:
    """The comparison of every pair of a main-job record, one table each; `prompts` per step (0: the record's,
    `record_prompts`)."""
    prompts = prompts or record_prompts(record)
    out = []
    for plain, spec in pairs(record):
        out.append(f"{spec['variant']} vs plain, seed {spec['seed']} ({prompts} prompts x {MAIN_JOB_GROUP} a step; "
                   "per RL step; host rates from the plain run)")
        out.append(f"  {'figure':18} {'measured':>9} {'simulated':>9} {'error':>7}")
        for r in compare_pair(plain, spec, prompts=prompts, **{**record_drafter(record), **kwargs}):
            out.append(f"  {r.name:18} {r.measured:9.3f} {r.simulated:9.3f} {100 * r.error:6.0f}%")
    if not out:
        raise ValueError("the record has no plain run beside a run that speculated, for the same seed")
    return "\n".join(out)



