"""The figures of the results page's section "At scale, on a CPU"."""

import re

from .base import R, Figure, Given, span

MEMORY = "research/records/megatron_memory_1024x14.json"
COMBINED = "research/records/at_scale_tiny_moe_combined.json"
OFFLOAD = "research/records/at_scale_tiny_moe_tp2_offload.json"
LINK = "research/records/refit_link.json"
AUDIT = "research/records/audit_vs_measured_cpu.json"
SCHEDULE = "research/records/megatron_schedule.json"
ASYNC = "research/records/async_save_megatron_writer_process_2threads.json"
ROUTING = "research/records/routing_replay_trainers.json"
ROUTING_VLLM = "research/records/routing_replay_vllm.json"
GATE_VLLM = "research/records/vllm_step_gate.json"
GATE_VLLM_PROCESSES = "research/records/vllm_step_gate_engine_processes.json"
INFLIGHT = "research/records/inflight_parity_spanning_40steps.json"
RANKS = ("0", "1", "2", "3")


def model(r: dict) -> list[float]:
    m = r["model"]
    return [m["params"] / 1e9, m["experts"], m["top_k"]]


def layout(r: dict) -> list[int]:
    """Ranks and GRPO steps; the layout must be the EP2 x PP2 the page names."""
    if not r["layout"].startswith("EP2 x PP2"):
        raise ValueError(f"layout {r['layout']!r}")
    return [len(r["share_of_training_state_mb"]), len(r["losses"])]


def rank_peaks(r: dict) -> list[float]:
    """Each trainer rank's peak resident set measured from outside, MB: least and greatest."""
    return span(r["outside_peak_mb"][k]["hwm"] for k in RANKS)


def rank_bound(r: dict) -> list[float]:
    """The allowance above the rank's share, the bound, and how far the logged peak is from the outside one (MB);
    every rank must be below its bound."""
    checks = [r["budget_check"][k] for k in RANKS]
    if not all(c["below"] and c["outside_mb"] < c["bound_mb"] for c in checks):
        raise ValueError("a rank is not below its bound")
    (allowance,) = {round(c["bound_mb"] - s, 6) for c, s in zip(checks, r["share_of_training_state_mb"])}
    return [allowance, max(c["bound_mb"] for c in checks), max(abs(c["outside_mb"] - c["logged_mb"]) for c in checks)]


def shards(r: dict) -> list[float]:
    """Shard files, two per rank (else the page is wrong), and the largest one's share of the fp32 model."""
    files = [f for f in r["checkpoint_files_bytes"] if f.endswith(".distcp")]
    per_rank = {rank: sum(1 for f in files if re.search(rf"__{rank}_\d+\.distcp$", f)) for rank in RANKS}
    if set(per_rank.values()) != {2}:
        raise ValueError(f"shard files per rank: {per_rank}")
    return [len(files), r["largest_checkpoint_file_share_of_model"]]


def resumed(r: dict) -> list[float]:
    """Step 1 resumed at EP2 x PP1 against step 1 straight: relative differences of loss and grad norm."""
    a, b = r["resume"]["step1_straight"], r["resume"]["step1_resumed"]
    return [abs(b[k] - a[k]) / abs(a[k]) for k in ("loss", "grad_norm")]


def sync_run(r: dict) -> list[dict]:
    (run,) = [x for x in r["runs"] if "async_lag" not in x["command"]]
    return run["metrics"]


def lagged_run(r: dict) -> list[float]:
    """The `backend.async_lag=1` run: acceptance range and the policy lag after the first step (the mismatch is not
    measured on lagged steps)."""
    (run,) = [x for x in r["runs"] if "backend.async_lag=1" in x["command"]]
    steps = run["metrics"]
    (lag,) = {s["policy_lag"] for s in steps[1:]}
    if steps[0]["policy_lag"] != 0 or any(s["logprob_mismatch"] is not None for s in steps[1:]):
        raise ValueError("the lagged run's first step lagged, or a lagged step logged a mismatch")
    return [*span(s["acceptance_length"] for s in steps), lag]


def offload_steps(r: dict) -> list[float]:
    if {s["weight_sync_transport"] for s in r["steps"]} != {"collective"}:
        raise ValueError("a refit did not go through the collective")
    return [max(s["logprob_mismatch"] for s in r["steps"]), *span(s["acceptance_length"] for s in r["steps"])]


def link_rows(r: dict) -> list[dict]:
    """The refit against the link, by bucket size (smallest first)."""
    return sorted(r["rows"], key=lambda x: x["bucket_mb"])


def schedule(run: dict) -> list[float]:
    """One call against one per shape: the fastest train step of each, their ratio, and the calls a pass."""
    one, per = run["one_call"], run["per_shape"]
    return [one["min_s"], per["min_s"], per["min_s"] / one["min_s"], one["schedule_calls"], per["schedule_calls"]]


FIGURES: list[Figure] = [
    Figure(R, "a random 0.74 B Qwen3-MoE (16 experts, top-2)", MEMORY, model),
    Figure(R, "on 4 gloo ranks, 2 GRPO steps", MEMORY, layout),
    Figure(R, "peaks at 4003-4434 MB", MEMORY, rank_peaks),
    Figure(R, "training state + 1536 MB (4507 MB), logged = outside within 0.8 MB", MEMORY, rank_bound),
    Figure(R, "8 shard files (two per rank) of at most 0.39 of the model", MEMORY, shards),
    Figure(R, "loss equal to 2e-9, grad norm to 2e-8 (relative)", MEMORY, resumed),
    Figure(R, "acceptance length 3.18-3.66 in its 3 steps", COMBINED,
           lambda r: [*span(s["acceptance_length"] for s in sync_run(r)), len(sync_run(r))]),
    Figure(R, "log-prob mismatch at most 1.6e-5", COMBINED, lambda r: max(s["logprob_mismatch"] for s in sync_run(r))),
    Figure(R, "acceptance length 3.18-3.63 and policy lag 1 after the first step", COMBINED, lagged_run),
    Figure(R, "log-prob mismatch at most 1.2e-5, acceptance length 3.18-3.66, transport `collective`", OFFLOAD,
           offload_steps),
    Figure(R, "562 -> 553, 675 -> 582 and 688 -> 584 MB while offloaded", OFFLOAD, lambda r: [
        x for s in r["steps"] for x in (s["trainer_offload"]["trainer_rss_mb_before_offload"],
                                         s["trainer_offload"]["trainer_rss_mb_offloaded"])]),
    Figure(R, "engine actor 756 MB", OFFLOAD, lambda r: max(s["engine_memory"]["engine_peak_rss_mb"][0]
                                                             for s in r["steps"])),
    Figure(R, "its vLLM worker processes 2849-2896 MB together at peak", OFFLOAD,
           lambda r: span(s["engine_memory"]["engine_workers_peak_rss_mb"][0] for s in r["steps"])),
    Figure(R, "538 MB a refit", LINK, lambda r: link_rows(r)[0]["bytes"] / 1e6),
    Figure(R, "0.63-1.00 of the link's throughput at buckets of 16-256 MiB (2.04-2.43 GB/s", LINK,
           lambda r: [*span(x["refit_over_link_throughput"] for x in link_rows(r)), link_rows(r)[0]["bucket_mb"],
                      link_rows(r)[-1]["bucket_mb"], *span(x["refit_gb_per_s"] for x in link_rows(r))]),
    Figure(R, "at the CPU default of 64 MiB 0.224 s against 0.160 s", LINK,
           lambda r: [64, *[next(x for x in link_rows(r) if x["bucket_mb"] == 64)[k]
                            for k in ("refit_median_s", "link_median_s")]]),
    Figure(R, "the memory audit's CPU mode predicts each rank within 12 %", AUDIT, lambda r: 100 * r["max_abs_error"]),
    Figure(R, "17 micro-batches at PP2, 9 a rank at PP2 x EP2", SCHEDULE,
           lambda r: [len(r["pp2"]["micro_batches"]), len(r["pp2_ep2"]["micro_batches"])]),
    Figure(R, "PP2 train step 0.324 s against 0.535 s (1.65x; 1 call against 14), PP2 x EP2 0.526 s against 0.566 s "
           "(1.08x)", SCHEDULE, lambda r: [*schedule(r["pp2"]), *schedule(r["pp2_ep2"])[:3]]),
    Figure(R, "-9 % (one call) and -8 % (per shape)", SCHEDULE,
           lambda r: [100 * r["sim_pp2"][k]["error"] for k in ("one_call", "per_shape")]),
    Figure(R, "a 0.32 B Qwen3-MoE on the Megatron trainer, one process, 3.8 GB", ASYNC,
           lambda r: [r["model"]["params"] / 1e9, r["median"]["foreground"]["checkpoint_bytes"] / 1e9]),
    Figure(R, "0.53 s at the save boundary against 3.25 s", ASYNC,
           lambda r: [r["median"][k]["save_blocking_s"] for k in ("background_process", "foreground")]),
    Figure(R, "takes 1.07x a plain step with the writer process", ASYNC,
           lambda r: r["ratio_per_round_median"]["background_process_step_s_over_none_step"]),
    Figure(R, "1.60x with a writer thread", ASYNC,
           lambda r: r["ratio_per_round_median"]["background_step_s_over_none_step"]),
    Figure(R, "a step and its save 5.27 s against 6.60 s", ASYNC,
           lambda r: [r["median"][k]["critical_s"] for k in ("background_process", "foreground")]),
]



def routing(r: dict, dtype: str, mode: str, stat: str, agg: str) -> float:
    return r["engines"][dtype]["embedded"]["summary"][mode][stat][agg]


def trainers_apart(r: dict) -> float:
    """The most a step's figure differs between the embedded and the Megatron trainer."""
    return max(abs(a[mode][stat] - b[mode][stat]) for e in r["engines"].values()
               for a, b in zip(e["embedded"]["steps"], e["megatron"]["steps"])
               for mode in ("free", "replay") for stat in ("logprob_mismatch", "mean_abs", "routing_differs"))


def none_with_replay(r: dict, dtype: str, figures: list) -> list:
    """`figures`, once no routing choice differs with replay (what the row says in words)."""
    if routing(r, dtype, "replay", "routing_differs", "max") != 0:
        raise ValueError(f"{dtype}: routing choices differ with replay")
    return figures


def fp32_routing(r: dict) -> list:
    """With an fp32 engine no routing choice differs, with replay or without: the larger mismatch of the two."""
    if routing(r, "float32", "free", "routing_differs", "max") != 0:
        raise ValueError("float32: routing choices differ without replay")
    return none_with_replay(r, "float32", [max(routing(r, "float32", m, "logprob_mismatch", "max")
                                                for m in ("free", "replay"))])


def inflight(r: dict, run: str, key: str) -> list:
    """`key` of `run` for every seed, in seed order."""
    return [r["seeds"][s][run][key] for s in sorted(r["seeds"], key=int)]


def accuracies(r: dict) -> list:
    """Held-out accuracy before (per seed), after in flight, after synchronously; both runs of a seed must start
    from the same accuracy, which the row prints once."""
    before = inflight(r, "lag2_inflight_ray", "eval_accuracy_before")
    if before != inflight(r, "sync_inline", "eval_accuracy_before"):
        raise ValueError("the two runs of a seed start from different held-out accuracies")
    return before + inflight(r, "lag2_inflight_ray", "eval_accuracy") + inflight(r, "sync_inline", "eval_accuracy")


def spanning(r: dict) -> list:
    """Per seed the steps whose rollouts spanned two or more versions, the steps of a run, and the most versions
    one rollout's tokens spanned."""
    steps = set(inflight(r, "lag2_inflight_ray", "steps"))
    if steps != {r["steps"]}:
        raise ValueError(f"runs of {steps} steps in a record of {r['steps']}")
    return [*inflight(r, "lag2_inflight_ray", "steps_spanning_versions"), r["steps"],
            max(inflight(r, "lag2_inflight_ray", "rollout_version_span_max"))]


def seed_difference(r: dict, seed: str) -> list:
    """The seed as printed, then its in-flight minus synchronous accuracy and that difference's standard error."""
    d = r["accuracy_difference"]
    return [int(seed), d["per_seed"][seed], d["per_seed_se"][seed]]


FIGURES += [
    Figure(R, "5 steps of", ROUTING, lambda r: len(r["engines"]["bfloat16"]["embedded"]["steps"])),
    Figure(R, "with a bf16 engine 0.72 % of the routing choices differ from the trainer's (1.04 % at most), none with "
           "replay", ROUTING, lambda r: none_with_replay(r, "bfloat16", [
               100 * routing(r, "bfloat16", "free", "routing_differs", a) for a in ("median", "max")])),
    Figure(R, "the worst step's mean log-prob gap 0.0034 -> 0.0024, the median step's 0.0021 either way", ROUTING,
           lambda r: [routing(r, "bfloat16", m, "mean_abs", "max") for m in ("free", "replay")]
           + [routing(r, "bfloat16", "free", "mean_abs", "median")]),
    Figure(R, "with an fp32 engine no choice differs and the mismatch is at most 2.0e-5 either way", ROUTING,
           fp32_routing),
    Figure(R, "the two trainers' figures differ by at most 1.2e-5", ROUTING, trainers_apart),
    Figure(R, "with a bf16 vLLM engine 0.50 % of the routing choices differ from the trainer's (0.64 % at most), none "
           "with replay", ROUTING_VLLM, lambda r: none_with_replay(r, "bfloat16", [
               100 * routing(r, "bfloat16", "free", "routing_differs", a) for a in ("median", "max")])),
    Figure(R, "the worst step's mean log-prob gap 0.0024 -> 0.0022, the median step's 0.0019 either way", ROUTING_VLLM,
           lambda r: [routing(r, "bfloat16", m, "mean_abs", "max") for m in ("free", "replay")]
           + [routing(r, "bfloat16", "free", "mean_abs", "median")]),
    Figure(R, "with an fp32 vLLM engine no choice differs and the mismatch is at most 1.8e-5 either way", ROUTING_VLLM,
           fp32_routing),
    Figure(R, "1.04x by median (0.23-0.29 s against 0.23-0.28 s), speculating 3.82x", GATE_VLLM,
           lambda r: [r["ratio_to_plain"]["gate_off"], *span(r["seconds"]["gate_off"]), *span(r["seconds"]["plain"]),
                      r["ratio_to_plain"]["spec"]]),
    Figure(R, "in a process of its own 1.06x by median, single rounds 0.33-0.86 s plain and 0.40-2.15 s gated",
           GATE_VLLM_PROCESSES, lambda r: [r["ratio_to_plain"]["gate_off"], *span(r["seconds"]["plain"]),
                                           *span(r["seconds"]["gate_off"])]),
    Figure(R, "held-out accuracy 0.320 / 0.320 / 0.273 -> 0.641 / 0.484 / 0.945 in flight against 0.516 / 0.469 / "
           "0.945 synchronous", INFLIGHT, accuracies),
    Figure(R, "in flight minus synchronous +0.047 ± 0.031 over the seeds (1.5 standard errors", INFLIGHT,
           lambda r: [r["accuracy_difference"][k] for k in ("mean", "mean_se", "mean_in_se")]),
    Figure(R, "seed 0 alone +0.125 ± 0.061", INFLIGHT, lambda r: seed_difference(r, "0")),
    Figure(R, "rollouts spanned two or more versions on 32 / 29 / 34 of the 40 steps, up to 3 versions in one "
           "rollout", INFLIGHT, spanning),
    Figure(R, "policy lag at most 2", INFLIGHT, lambda r: max(inflight(r, "lag2_inflight_ray", "policy_lag_max"))),
    Figure(R, "the refit waited 9-166 ms (median) beside generations of 1.4-19 s", INFLIGHT,
           lambda r: [1e3 * x for x in span(inflight(r, "lag2_inflight_ray", "weight_sync_wait_s_median"))]
           + span(inflight(r, "lag2_inflight_ray", "engine_generate_s_median"))),
]

GIVEN: list[Given] = [
    Given(R, "8 x 8 rollouts", "the routing-replay script's batch: 8 prompts, 8 rollouts each"),
]
