"""The figures of the results page's section "On a GPU"."""

import re

from .base import R, Figure, Given, span

SCALE = "research/records/gpu_h100_scale.json"
LOG = "research/records/gpu_tier_h100_scale.log"
IPC = "research/records/refit_cuda_ipc_h100.json"
SAVE_ERROR = "save_sharded with backend.megatron.optimizer=megatron is not wired yet"


def log_part(log: str, title: str) -> str:
    """The lines of the log under one `== title ==` header, up to the next."""
    return log.split(f"== {title} ==\n", 1)[1].split("\n== ", 1)[0]


def passed(log: str) -> int:
    (count,) = re.findall(r"^(\d+) passed\b", log_part(log, "GPU tier"), re.M)
    return int(count)


def steps_then_save_error(log: str) -> int:
    """The loop's steps the log printed before the checkpoint save failed with SAVE_ERROR (which must follow them)."""
    loop = log_part(log, "the RL loop with the Megatron trainer on the GPU")
    before, error, _ = loop.partition(SAVE_ERROR)
    if not error:
        raise ValueError(f"the log has no {SAVE_ERROR!r}")
    return len(re.findall(r"^step \d+/\d+ \|", before, re.M))


def megatron_steps(r: dict) -> list[dict]:
    """The 3 steps of the bf16 Megatron-Core check, dense then MoE."""
    return [s for kind in ("dense", "moe") for s in r["megatron_bf16_distributed_optimizer_recompute"][kind]["steps"]]


def megatron_memory(r: dict) -> list[float]:
    """Peak allocated and reserved device memory, the same in every step of dense and MoE (else the page is wrong)."""
    peaks = {(m["trainer_cuda_peak_allocated_mb"][0], m["trainer_cuda_peak_reserved_mb"][0])
             for m in (s["memory"] for s in megatron_steps(r))}
    if len(peaks) != 1:
        raise ValueError(f"dense and MoE peaks differ: {sorted(peaks)}")
    return list(peaks.pop())


def weights(r: dict) -> list[float]:
    runs = r["megatron_bf16_distributed_optimizer_recompute"].values()
    (steps,) = {len(run["steps"]) for run in runs}
    return [steps, max(run["weight_max_diff"] for run in runs)]


def loop(r: dict) -> dict:
    """The loop's record; its command must have had speculation and the MTP layer off, as the page says."""
    job = r["loop_megatron_gpu"]
    if not {"spec=null", "backend.megatron.mtp_num_layers=0"} <= set(job["command"].split()):
        raise ValueError(f"the loop ran with speculation or an MTP layer: {job['command']}")
    return job


def ipc(r: dict) -> list[float]:
    """GB/s of each transport (from the sender's seconds), their ratio; both must have arrived bitwise."""
    rows = {row["transport"]: row for row in r["rows"]}
    if not all(row["receiver"]["bitwise_equal"] for row in rows.values()):
        raise ValueError("a transport did not arrive bitwise")
    gbs = [rows[t]["bytes"] / rows[t]["sender"]["seconds"] / 1e9 for t in ("cuda_ipc", "gloo")]
    return [*gbs, gbs[0] / gbs[1]]


def sender_memory(r: dict) -> float:
    """The CUDA IPC sender's extra device memory, MB, which the page calls two buckets."""
    extra = next(row for row in r["rows"] if row["transport"] == "cuda_ipc")["sender"]["extra_peak_device_mb"]
    if extra != 2 * r["bucket_bytes"] / 2**20:
        raise ValueError(f"{extra} MB is not two buckets")
    return extra


FIGURES: list[Figure] = [
    Figure(R, "26 passed", LOG, passed),
    Figure(R, "log-probs within 0.006", SCALE, lambda r: max(s["logprob_max_diff"] for s in megatron_steps(r))),
    Figure(R, "loss within 1e-6", SCALE, lambda r: max(abs(s["loss"] - s["loss_fp32_cpu"]) for s in megatron_steps(r))),
    Figure(R, "grad norm within 0.15 %", SCALE, lambda r: max(
        100 * abs(s["grad_norm"] - s["grad_norm_fp32_cpu"]) / s["grad_norm_fp32_cpu"] for s in megatron_steps(r))),
    Figure(R, "weights after 3 steps at most 0.0068 apart", SCALE, weights),
    Figure(R, "5.3e-5 (dense) and 6.5e-5 (MoE) on average", SCALE, lambda r: [
        r["megatron_bf16_distributed_optimizer_recompute"][k]["weight_mean_diff"] for k in ("dense", "moe")]),
    Figure(R, "peak device memory 116 MB allocated, 202 MB reserved (dense and MoE alike)", SCALE, megatron_memory),
    Figure(R, "3 steps ran with speculation off (`spec=null`, no MTP layer)", SCALE, lambda r: len(loop(r)["steps"])),
    Figure(R, "engine-vs-trainer log-prob mismatch 0.12-0.14", SCALE,
           lambda r: span(s["logprob_mismatch"] for s in loop(r)["steps"])),
    Figure(R, "peak 127.7 / 141.3 / 141.6 MB allocated", SCALE,
           lambda r: [s["memory"]["trainer_cuda_peak_allocated_mb"][0] for s in loop(r)["steps"]]),
    Figure(R, f"after 3 steps the checkpoint save failed: `{SAVE_ERROR}`", LOG, steps_then_save_error),
    Figure(R, "2 GiB bf16 in 256 MiB buckets", IPC,
           lambda r: [r["rows"][0]["bytes"] / 2**30, r["bucket_bytes"] / 2**20]),
    Figure(R, "CUDA IPC **36.2 GB/s** against 0.5 GB/s through the gloo group (68.7x), both bitwise", IPC, ipc),
    Figure(R, "sender's extra device memory 512 MB (two buckets)", IPC, sender_memory),
]

GIVEN: list[Given] = [
    Given(R, "(bound 0.05)", "the GPU test's bound on the log-prob difference of Megatron-Core in bf16 against the "
          "fp32 step (tests/trainers/megatron/test_gpu.py: 8 significant bits per op, O(1) logits, tens of ops)"),
]
