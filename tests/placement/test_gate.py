"""The whole-step gate on Ray worker groups: the trainer group forwards `speculation` to its rank 0's policy, the
generator group to its engines call by call, so a gated Ray run's plain steps are `spec=null` steps and its
speculative steps speculate and train the drafter."""

import pytest
import torch

from megatron_spec.drafters.config import SpecConfig
from megatron_spec.engine import SamplingParams
from megatron_spec.generators.embedded import EmbeddedGenerator
from megatron_spec.models import from_pretrained
from megatron_spec.placement.driver import RayTrainer
from megatron_spec.rl import loop
from megatron_spec.rl.logging import read_metrics
from tests.placement.test_driver import ray_cfg
from tests.rl.test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=14)
COMPARED = ["gen_tokens", "reward_mean", "loss", "response_len_max"]


class Gated(RayTrainer):
    """The driver with a gate whose margin lets any speculative step's drafter train (so step 2 does, whatever its
    gen stage cost on a loaded machine), and, before it closes, greedy generations of the final weights by the
    engine group with speculation off and on."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gate.margin = 1e-9
        self.greedy = None

    def close(self):
        self.refit()  # the final weights into the engine (lag 0: loaded before it returns)
        prompts = [self.task.encode(p) for p in self.task.problems(0, 4)]
        with self.generator.speculation(False):
            off = self.generator.generate(prompts, GREEDY)
        on = self.generator.generate(prompts, GREEDY)
        self.greedy = prompts, off, on, self.policy.state_dict()["model"]
        super().close()


def test_gated_ray_run_has_plain_and_speculative_steps(ray_cluster, ckpts, tmp_path, shaped_reward):  # noqa: F811
    """Embedded trainer and engine in Ray actors, MTP adaptive with the gate, 3 synchronous steps: the gate's
    warm-up and its pricing step run plainly, the third speculates.

    - plain steps: no draft verified (`acceptance_length` None) and no drafter training (`drafter_s` absent: the
      trainer actor's policy was inside `speculation(False)`), and the same rollouts and loss as the in-process
      `spec=null` run of the seed (the drafter never touches the policy);
    - the speculative step verifies drafts and trains the drafter;
    - after the run, greedy generation by the engine group inside `speculation(False)` reports no speculation and
      equals an in-process plain engine on the final weights, token for token, as does the speculative one, which
      drafts."""
    cfg = ray_cfg(ckpts, tmp_path / "gated", "disaggregated")
    cfg.spec = SpecConfig("mtp", 3, adaptive=True)
    made = []
    loop.run(cfg, lambda c: made.append(Gated(c)) or made[0])
    gated = read_metrics(tmp_path / "gated")
    loop.train(small_cfg(ckpts, tmp_path / "plain", spec=None))
    plain = read_metrics(tmp_path / "plain")
    assert [m["speculate"] for m in gated] == [False, False, True]
    for g, p in zip(gated[:2], plain[:2]):
        assert g["acceptance_length"] is None and "drafter_s" not in g and not g["drafter_trained"]
        assert [g[k] for k in COMPARED] == [p[k] for k in COMPARED]
    assert gated[2]["acceptance_length"] >= 1 and gated[2]["drafter_s"] > 0 and gated[2]["drafter_trained"]

    prompts, off, on, weights = made[0].greedy
    model = from_pretrained(cfg.model.policy)
    model.load_state_dict(weights)
    reference = EmbeddedGenerator(model, own=True).generate(prompts, GREEDY)
    assert [o.token_ids for o in off] == [o.token_ids for o in on] == [o.token_ids for o in reference]
    assert all(not o.spec for o in off)
    assert sum(o.spec.get("drafted", 0) for o in on) > 0


def test_gated_run_with_a_lag_trains_each_step_in_its_rollouts_mode(ray_cluster, ckpts, tmp_path,
                                                                      shaped_reward):  # noqa: F811
    """Lag 1, the same gated setup, 5 steps: the gate decides each generation's mode when it is submitted, one step
    ahead, so the modes run plain (the warm-up), plain twice (submitted before a plain step was priced; both
    priced), then speculative twice (the probe, submitted again before its own cost was known). Each step trains in its rollouts' mode: plain steps verify no draft and skip the drafter's
    training, speculative ones verify drafts and train it. Each recorded price is the longer side per generated
    token, `max(engine_generate_s, the other stages' seconds) / gen_tokens`, recomputed here from the logged
    metrics (the gen stage itself, only a wait here, does not enter it)."""
    cfg = ray_cfg(ckpts, tmp_path / "lagged", "disaggregated", lag=1, steps=5)
    cfg.spec = SpecConfig("mtp", 3, adaptive=True)
    made = []
    loop.run(cfg, lambda c: made.append(Gated(c)) or made[0])
    metrics = read_metrics(tmp_path / "lagged")
    modes = [m["speculate"] for m in metrics]
    assert modes == [False, False, False, True, True]
    for m in metrics:
        assert m["policy_lag"] <= 1
        if m["speculate"]:
            assert m["acceptance_length"] >= 1 and m["drafter_s"] > 0 and m["drafter_trained"]
        else:
            assert m["acceptance_length"] is None and "drafter_s" not in m and not m["drafter_trained"]

    def price(m):
        other = sum(t for name, t in m["stages"].items() if name != "gen")
        return max(m["engine_generate_s"], other) / m["gen_tokens"]

    costs = made[0].gate.costs
    assert list(costs[False]) == pytest.approx([price(m) for m in metrics[1:3]], rel=1e-12)
    assert list(costs[True]) == pytest.approx([price(m) for m in metrics[3:5]], rel=1e-12)
