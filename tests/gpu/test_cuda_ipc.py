"""The CUDA IPC refit transport (`weight_group.CudaIpcWeightGroup`) between two processes on one GPU, a colocated trainer and
engine: every tensor arrives bit for bit, over several buckets, and the sender never holds more than about one
bucket beyond its own weights (the acknowledgement frees each buffer before the next is cast)."""

from __future__ import annotations

from benchmarks.refit_cuda_ipc import BUCKET_BYTES, refit


def test_cuda_ipc_refit_is_bitwise_and_holds_one_bucket():
    """768 MiB in 256 MiB buckets (3 buckets): the receiver's copy equals the sender's weights exactly; the
    sender's extra device memory stays within 2 buckets (the cast buffer plus the concatenated payload of one
    bucket; a sender that kept every bucket alive would hold 3 or more)."""
    row = refit("cuda_ipc", 3 * BUCKET_BYTES)
    assert row["receiver"]["bitwise_equal"] is True
    assert row["bytes"] == 3 * BUCKET_BYTES
    assert row["sender"]["extra_peak_device_mb"] <= 2 * BUCKET_BYTES / 2**20 + 1
