"""The figures of the results page's section "At scale, on a CPU"."""

import re

from .base import R, Figure, Given, span

MEMORY = "research/records/megatron_memory_1024x14.json"
COMBINED = "research/records/at_scale_tiny_moe_combined.json"
OFFLOAD = "research/records/at_scale_tiny_moe_tp2_offload.json"
REFIT = "research/records/refit_collective.json"
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


def run(r: dict, transport: str) -> dict:
    return next(x for x in r["runs"] if x["transport"] == transport)


FIGURES: list[Figure] = [
    Figure(R, "a random 0.74 B Qwen3-MoE (16 experts, top-2)", MEMORY, model),
    Figure(R, "on 4 gloo ranks, 2 GRPO steps", MEMORY, layout),
    Figure(R, "peaks at 4051-4320 MB", MEMORY, rank_peaks),
    Figure(R, "training state + 1536 MB (4507 MB), logged = outside within 1.2 MB", MEMORY, rank_bound),
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
    Figure(R, "538 MB a refit", REFIT, lambda r: run(r, "collective")["bytes"] / 1e6),
    Figure(R, "collective **0.54 GB/s** (1.00 s a refit, median of 5)", REFIT, lambda r: [
        run(r, "collective")["gb_per_s"], run(r, "collective")["median_s"], len(run(r, "collective")["seconds"])]),
    Figure(R, "object store 0.26 GB/s (2.08 s)", REFIT,
           lambda r: [run(r, "object_store")["gb_per_s"], run(r, "object_store")["median_s"]]),
    Figure(R, "357 / 487 MB collective, 1409 / 1467 MB object store", REFIT, lambda r: [
        run(r, t)["peak_rss_above_start_mb"][side] for t in ("collective", "object_store")
        for side in ("trainer", "engine")]),
    Figure(R, "measured at load ~14 from other jobs", REFIT, lambda r: r["load_average_1_5_15"][0]),
]

GIVEN: list[Given] = []
