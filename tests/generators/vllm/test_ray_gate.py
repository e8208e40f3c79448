"""The whole-step gate on a Ray engine group of vLLM engine actors (`tests/placement/test_gate.py` runs it with our
engine): plain steps verify no draft and train no drafter. Here rather than with the other Ray tests because it
needs vLLM, which CI's vLLM tier installs."""

import pytest

from megatron_spec.drafters.config import SpecConfig
from megatron_spec.rl import loop
from megatron_spec.rl.logging import read_metrics
from tests.generators.vllm.common import vllm_only
from tests.placement.test_driver import ray_cfg
from tests.placement.test_gate import Gated
from tests.rl.test_loop import ckpts, shaped_reward  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.ray, *vllm_only]


def test_gated_ray_run_on_a_vllm_engine(ray_cluster, ckpts, tmp_path, shaped_reward):  # noqa: F811
    """The same gated run with a vLLM engine actor (MTP exported into it): the two plain steps verify no draft and
    train no drafter, the third speculates and trains it; after the run, the engine's greedy generation inside
    `speculation(False)` reports no speculation and equals its speculative one, which drafts, token for token."""
    cfg = ray_cfg(ckpts, tmp_path, "disaggregated")
    cfg.spec = SpecConfig("mtp", 3, adaptive=True)
    cfg.backend.generator = "vllm"
    made = []
    loop.run(cfg, lambda c: made.append(Gated(c)) or made[0])
    gated = read_metrics(tmp_path)
    assert [m["speculate"] for m in gated] == [False, False, True]
    for g in gated[:2]:
        assert g["acceptance_length"] is None and "drafter_s" not in g and not g["drafter_trained"]
    assert gated[2]["acceptance_length"] >= 1 and gated[2]["drafter_s"] > 0
    _, off, on, _ = made[0].greedy
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert all(not o.spec for o in off) and sum(o.spec.get("drafted", 0) for o in on) > 0
