"""The default suite's settings for the research tests too: one torch thread unless told, and a fixed seed."""

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("MEGATRON_SPEC_TEST_THREADS", "1")))
os.environ.setdefault("MEGATRON_SPEC_KERNELS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
