"""The combined asynchronous run: a tiny MoE trained by Megatron-Core (EP 2, two Ray actors) while a vLLM engine
actor generates one step ahead and takes each refit between two of its engine steps (`backend.in_flight_updates`),
so rollouts span policy versions and each token carries the behaviour log-prob of the weights that sampled it."""

import json
import shutil

import pytest

from megatron_spec.rl import loop
from megatron_spec.rl.logging import read_metrics
from tests.generators.vllm.common import vllm_only
from tests.placement.test_driver import moe_policy, ray_cfg  # noqa: F401  (fixture)
from tests.placement.test_inflight import Recording, early_reward, spanning_rollouts  # noqa: F401  (fixture)
from tests.rl.test_loop import ckpts  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, *vllm_only]

STEPS = 4
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def long_moe(moe_policy, tmp_path_factory):  # noqa: F811
    """The tiny MoE with no end token (vLLM refuses one outside the vocabulary), so every rollout runs MAX_TOKENS:
    the engine is then generating when a refit comes."""
    root = tmp_path_factory.mktemp("long_moe") / "policy"
    shutil.copytree(moe_policy, root)
    config = json.loads((root / "config.json").read_text())
    config["eos_token_id"] = None
    (root / "config.json").write_text(json.dumps(config))
    return root


class MegatronRecording(Recording):
    """`Recording` of a Megatron trainer, whose state holds its full HF-named weights under "weights"."""

    key = "weights"


def test_megatron_ep2_with_vllm_in_flight_updates(ray_cluster, ckpts, long_moe, tmp_path, early_reward):  # noqa: F811
    """Megatron EP 2 trainer, one vLLM engine, lag 1 with in-flight updates, 4 steps of 8 rollouts of 160 tokens:
    some rollout's tokens span two policy versions (each rollout's versions never decrease; the logged span is the
    recorded one), and every token's behaviour log-prob equals a forward of the trainer's weights at that token's
    version within 1e-4 (both fp32: the engine serves the checkpoint's dtype); a spanning rollout also has a token
    whose log-prob under its other version differs by more than 1e-3, so a token sampled by the wrong weights would
    be caught."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    cfg = ray_cfg(ckpts, tmp_path, "disaggregated", lag=1, steps=STEPS)
    cfg.model.policy, cfg.model.drafter, cfg.spec = str(long_moe), None, None
    cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.max_tokens = 2, 4, MAX_TOKENS
    cfg.backend.trainer, cfg.backend.generator, cfg.backend.megatron.ep = "megatron", "vllm", 2
    cfg.backend.in_flight_updates = True
    made = []
    loop.run(cfg, lambda c: made.append(MegatronRecording(c)) or made[0])
    trainer, metrics = made[0], read_metrics(tmp_path)
    for m in metrics:
        assert m["policy_lag"] <= 1
    spanning = spanning_rollouts(cfg, trainer, metrics)
    assert spanning > 0 and max(m["rollout_version_span_max"] for m in metrics) >= 2
