"""The Ray tests' one local cluster (`tests/placement/conftest.py`), for the tests here that run vLLM engines as Ray
actors: one session fixture, so every module of this directory shares it."""

from tests.placement.conftest import ray_cluster  # noqa: F401  (fixture)
