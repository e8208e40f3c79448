"""One local Ray cluster for the Ray tests of this directory (2 CPUs, no dashboard), shut down at the end.
Tests that need it are marked `ray` and run in CI's Ray tier (.ci/tier-ray); without Ray they skip."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="needs Ray: pip install 'megatron-spec[ray]'")
    if ray.is_initialized():  # this fixture's twin (tests/generators/vllm imports it) started it in this session
        yield ray
        return
    # address="local": a new cluster of our own, never one another process on this machine started
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
