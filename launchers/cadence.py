"""Before a SLURM job is submitted: its first checkpoint must come well inside its `--time`, and the signal it asks
for before the limit must fit in it. Plain data in, plain data out (no dependencies), so `--dryrun` runs it too.

The first save comes after `run.save_every` steps or `run.save_every_s` seconds (plus the step in flight),
whichever is first. The step time is the simulator's projection where the plan has one (`--tune`'s predicted
step, or the recipe's own layout projected by `launchers/projection.py`); without it only the time cadence can be
checked. A job whose first save would come after
`FIRST_SAVE_FRACTION` of its limit is refused: its only save would be the one on the signal, and a node failure
before it would lose the whole job.
"""

from __future__ import annotations

FIRST_SAVE_FRACTION = 0.5
"""The latest a job's first save may come, as a fraction of its time limit."""


def time_limit_s(time: str) -> int:
    """SLURM's `[D-]HH:MM:SS` in seconds."""
    days, _, hms = time.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86_400 + h * 3600 + m * 60 + s


def projected_step_s(plan: dict) -> float | None:
    """The simulator's step time the plan carries (`--tune`'s predicted step, else the plain-decoding projection of
    the recipe's own layout, `launchers/projection.py`), else None."""
    stages = (plan.get("tuned") or {}).get("predicted_stage_s")
    if stages:
        return float(stages["step"]) if "step" in stages else float(sum(stages.values()))
    return (plan.get("projected") or {}).get("step_s")


def first_save_s(run, step_s: float | None) -> float | None:
    """When the first checkpoint comes, in seconds from the loop's start (None: unknown without a step time)."""
    by_steps = run.save_every * step_s if run.save_every and step_s is not None else None
    by_time = run.save_every_s + (step_s or 0.0) if run.save_every_s is not None else None
    known = [t for t in (by_steps, by_time) if t is not None]
    return min(known) if known else None


def save_plan(run, time: str, step_s: float | None) -> dict:
    """What the plan prints about saving (the signal asked for, the cadences, the projected first save), or a
    ValueError naming the fix when the first save or the signal does not fit in `time`."""
    limit = time_limit_s(time)
    problems = []
    if run.signal_before_s >= limit:
        problems.append(f"run.signal_before_s={run.signal_before_s} is not below the job's time limit {time} "
                        f"({limit} s): lower it or raise --time")
    first = first_save_s(run, step_s)
    if first is not None and first > FIRST_SAVE_FRACTION * limit:
        steps = f"{run.save_every} steps x {step_s:.0f} s" if run.save_every and step_s is not None else ""
        problems.append(f"the first checkpoint would come {first / 3600:.2f} h into a {time} job (after "
                        f"{steps or f'run.save_every_s={run.save_every_s:g} s'}; more than "
                        f"{FIRST_SAVE_FRACTION:.0%} of its time): lower run.save_every, set run.save_every_s below "
                        f"{FIRST_SAVE_FRACTION * limit:.0f}, or raise --time")
    if problems:
        raise ValueError("; ".join(problems))
    return {"signal": f"B:USR1@{run.signal_before_s}" if run.signal_before_s else None,
            "signal_before_s": run.signal_before_s, "save_every": run.save_every, "save_every_s": run.save_every_s,
            "step_s_projected": None if step_s is None else round(step_s, 1),
            "first_save_s": None if first is None else round(first)}


def check_save_cadence(plan: dict, cfg) -> None:
    """A SLURM plan gets its `save` entry (printed by `--dryrun`, read by `render_sbatch` for `--signal`); raises
    ValueError when the first save or the signal does not fit the job's time. Local plans are left as they are."""
    if plan["executor"] in ("slurm", "ray-slurm"):
        plan["save"] = save_plan(cfg.run, plan["time"], projected_step_s(plan))
