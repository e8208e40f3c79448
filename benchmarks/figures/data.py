"""The figures of the sections "SmolLM2 from a dataset file, ..." and "Does the loop learn as a reference ..."."""

from math import sqrt

from .base import R, Figure, Given, span

GUARDED = "research/records/smollm2_data_learning_guarded.json"
UNGUARDED = "research/records/smollm2_data_learning.json"
TRL = "research/records/trl_learning_main_job.json"


def override(r: dict, key: str) -> int:
    """A setting the run was given on its command line (`key=value`)."""
    (value,) = [o.split("=", 1)[1] for o in r["overrides"] if o.startswith(key + "=")]
    return int(value)


def evals(r: dict) -> list[float]:
    """Held-out prompts; accuracy before the first update and at the end; the two evaluations between, each with its
    step."""
    _, (step1, acc1), (step2, acc2), _ = r["eval_accuracy"]
    return [override(r, "run.eval_prompts"), r["eval_accuracy_before"], r["eval_accuracy_last"],
            acc1, step1, acc2, step2]


def gain(r: dict) -> list[float]:
    """The gain in points, in held-out prompts, and the prompts; the four evaluations must rise step by step."""
    acc = [a for _, a in r["eval_accuracy"]]
    if len(acc) != 4 or any(b <= a for a, b in zip(acc, acc[1:])):
        raise ValueError(f"not a monotone rise over four evaluations: {acc}")
    n = override(r, "run.eval_prompts")
    return [r["gain_points"], r["gain_points"] / 100 * n, n]


def trl_runs(r: dict) -> list[float]:
    """Start accuracy over both seeds; end accuracy of ours, then TRL's, per seed; the steps; the seeds."""
    runs = r["runs"]
    return [*span(x[e]["start_accuracy"] for x in runs for e in ("ours", "trl")),
            *(x["ours"]["end_accuracy"] for x in runs), *(x["trl"]["end_accuracy"] for x in runs),
            r["steps"], *(x["seed"] for x in runs)]


def standard_error(r: dict) -> list[float]:
    """Eval prompts, and the binomial standard error of one eval at each run's final accuracy: least and greatest."""
    n = r["config"]["run"]["eval_prompts"]
    ends = [x[e]["end_accuracy"] for x in r["runs"] for e in ("ours", "trl")]
    return [n, *span(sqrt(p * (1 - p) / n) for p in ends)]


FIGURES: list[Figure] = [
    Figure(R, "30 steps in 29 min", GUARDED, lambda r: [r["steps_done"], r["wall_s"] / 60]),
    Figure(R, "4 prompts x 4 rollouts a step", GUARDED,
           lambda r: [override(r, "grpo.prompts_per_step"), override(r, "grpo.group_size")]),
    Figure(R, "(50 prompts) | 0.42 (before the first update) | 0.52 (0.46 at step 10, 0.48 at step 20)", GUARDED,
           evals),
    Figure(R, "| 1.41 | 1.40-1.56 over the last five steps", GUARDED,
           lambda r: [r["acceptance_length"][0], *span(r["acceptance_length"][-5:])]),
    Figure(R, "| 3.12 | 2.31-2.86 over the last three steps", GUARDED,
           lambda r: [r["drafter_loss"][0], *span(r["drafter_loss"][-3:])]),
    Figure(R, "at most 6.0e-5 over the run", GUARDED,
           lambda r: max(row["logprob_mismatch"] for row in r["rows"] if row["logprob_mismatch"] is not None)),
    Figure(R, "+10 points is 5 of the 50 held-out prompts", GUARDED, gain),
    Figure(R, "the same run rose 0.44 -> 1.00", UNGUARDED,
           lambda r: [r["eval_accuracy_before"], r["eval_accuracy_last"]]),
    Figure(R, "0.12-0.15 -> 0.88 / 0.95 (ours) and 0.81 / 0.89 (TRL) after 50 steps in seeds 0 / 1", TRL, trl_runs),
    Figure(R, "one 128-prompt eval has a binomial standard error of 0.02-0.03", TRL, standard_error),
]

GIVEN: list[Given] = []
