"""Test-wide settings: one torch thread (tiny models get slower, not faster, with a thread pool on a busy
2-core CI machine) and deterministic seeds."""

import pytest
import torch

from megatron_spec.models import CausalLM, preset

torch.set_num_threads(1)


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
