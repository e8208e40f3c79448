"""The GPU tier (`bash .ci/tier-gpu`): everything here is marked `gpu` and skips, saying why, where torch sees no
CUDA device (CI, the CPU machines)."""

import pytest
import torch


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=f"needs CUDA: torch {torch.__version__} sees no GPU"))
