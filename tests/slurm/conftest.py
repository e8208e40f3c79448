"""Every test under tests/slurm is marked `slurm` (CI's SLURM tier runs them against the live local cluster) and
gets the `cluster` fixture (the partition of that cluster)."""

from pathlib import Path

import pytest

from .cluster import cluster  # noqa: F401  (the fixture)


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.slurm)
