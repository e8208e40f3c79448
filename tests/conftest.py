"""Test-wide settings: one torch thread (tiny models get slower, not faster, with a thread pool on a busy
2-core CI machine) and deterministic seeds."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
