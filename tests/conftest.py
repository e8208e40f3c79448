"""Test-wide settings: the CPU kernels required (below), one torch thread by default (tiny models get slower, not
faster, with a thread pool on a busy 2-core CI machine; `MEGATRON_SPEC_TEST_THREADS=2` runs the suite with two, and
it must pass either way: a reduction split over threads sums in another order, so no tolerance may depend on it) and
deterministic seeds."""

import os

import pytest
import torch

from megatron_spec.models import CausalLM, preset

torch.set_num_threads(int(os.environ.get("MEGATRON_SPEC_TEST_THREADS", "1")))
# The engine's fused CPU kernels must build here: a failed build is an error in the tests, not a silent fallback
# to torch's ops (which would leave the kernels untested). `MEGATRON_SPEC_KERNELS=0` still turns them off.
os.environ.setdefault("MEGATRON_SPEC_KERNELS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny_model():
    """A random tiny Qwen3 with peaked next-token distributions (std 0.15 weights), so greedy paths and
    sampling both exercise non-trivial choices."""
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3")).eval()
    model.reset_parameters(std=0.15)
    return model


@pytest.fixture(scope="module")
def tiny_moe():
    torch.manual_seed(1)
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    model.reset_parameters(std=0.15)
    return model
