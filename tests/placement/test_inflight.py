"""In-flight weight updates on Ray (`backend.in_flight_updates`): with async lag 2 the engine takes each refit between
two decoding steps of the generation it runs, so rollouts span policy versions, each token's behaviour log-prob is
the log-prob under the weights its version names, and the trainer's refit no longer waits for queued generation."""

import json
import shutil

import pytest
import torch

from megatron_spec.placement.driver import RayTrainer, version_metrics
from megatron_spec.engine.params import Completion
from megatron_spec.models import from_pretrained
from megatron_spec.rl import loop
from megatron_spec.rl.backend_config import BackendSection
from megatron_spec.rl.logging import read_metrics
from megatron_spec.rl.task import PromptTask
from megatron_spec.speculative.sampling import processed_logprobs
from tests.placement.test_driver import ray_cfg
from tests.rl.test_loop import ckpts  # noqa: F401  (fixture)

STEPS = 6
MAX_TOKENS = 320


@pytest.fixture(scope="module")
def long_ckpts(ckpts, tmp_path_factory):  # noqa: F811
    """The tiny policy (and its MTP head) with an end token outside the vocabulary, so every rollout runs its
    MAX_TOKENS: a generation then takes longer than an update, and the engine is generating whenever a refit comes
    (a random tiny model ends a rollout at its 64-token vocabulary's EOS after ~64 tokens, and at that length an
    update takes as long as a generation)."""
    root = tmp_path_factory.mktemp("long") / "ckpts"
    shutil.copytree(ckpts, root)
    config = json.loads((root / "policy" / "config.json").read_text())
    config["eos_token_id"] = config["vocab_size"]
    (root / "policy" / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def early_reward(monkeypatch):
    """Reward 'token 20 among the first 12': a random tiny model earns it in some rollouts of a group and not in
    others, so the policy really moves every step (the versions differ)."""
    monkeypatch.setattr(PromptTask, "reward", lambda self, ids, problem: float(20 in ids[:12]))


def test_in_flight_updates_are_refused_without_a_lag():
    """Before any compute: without a lag there is no generation in flight to update (and inline, no worker to run
    one); the error names what to set. Both generators take them with a lag."""
    for placement in ("disaggregated", "inline"):
        with pytest.raises(ValueError, match="async_lag"):
            BackendSection(placement=placement, in_flight_updates=True)
    for generator in ("embedded", "vllm"):
        assert BackendSection(placement="colocated", generator=generator, async_lag=1, in_flight_updates=True)


def test_version_metrics():
    outs = [Completion([1, 2, 3], [0.0] * 3, "length", versions=[0, 0, 1]),
            Completion([1, 2], [0.0] * 2, "length", versions=[1, 1]),
            Completion([1, 2, 3], [0.0] * 3, "length", versions=[0, 2, 2])]
    assert version_metrics(outs) == {"rollout_version_span_max": 3, "rollout_versions_mean": 5 / 3}


class Recording(RayTrainer):
    """The driver, keeping each step's rollouts and the trainer's weights at every version (read from trainer rank
    0 after each update, under `key` in its state)."""

    key = "model"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.recorded, self.weights = [], [self.policy.state_dict()[self.key]]

    def rollouts(self, step, prompts):
        rollouts = super().rollouts(step, prompts)
        self.recorded.append((prompts, rollouts.outs))
        return rollouts

    def step(self, step):
        metrics = super().step(step)
        self.weights.append(self.policy.state_dict()[self.key])  # version self.version
        return metrics


def run(cfg):
    made = []
    loop.run(cfg, lambda c: made.append(Recording(c)) or made[0])
    return made[0], read_metrics(cfg.run.out_dir)


def spanning_rollouts(cfg, trainer: Recording, metrics: list[dict]) -> int:
    """How many of the recorded rollouts span policy versions, after checking every one of them: its versions never
    decrease and the step's logged span is the recorded one; every token's behaviour log-prob equals a forward of
    the trainer's weights at that token's version within 1e-4 (fp32 on both sides with the weights sent
    unchanged, so they differ only in summation order, ~1e-6; the bound leaves room for any thread count and
    instruction set); and a spanning rollout has a token whose log-prob under its other version differs by more
    than 1e-3, so a token sampled by the wrong weights would be caught."""
    models = []
    for state in trainer.weights:
        model = from_pretrained(cfg.model.policy)
        model.load_state_dict(state)
        models.append(model.eval())
    spanning = 0
    for step, ((prompts, outs), m) in enumerate(zip(trainer.recorded, metrics)):
        assert m["rollout_version_span_max"] == max(max(o.versions) - min(o.versions) + 1 for o in outs)
        for prompt, out in zip(prompts, outs):
            assert out.versions == sorted(out.versions) and len(out.versions) == len(out.token_ids)
            ids = torch.tensor([prompt + out.token_ids])
            tokens = torch.tensor(out.token_ids)[:, None]
            per_version = {}
            for v in set(out.versions):
                with torch.no_grad():
                    lp = processed_logprobs(models[v](ids)[0, len(prompt) - 1: -1], cfg.grpo.temperature,
                                            cfg.grpo.top_k, cfg.grpo.top_p)
                per_version[v] = lp.gather(-1, tokens).squeeze(-1)
            expected = torch.stack([per_version[v][j] for j, v in enumerate(out.versions)])
            gap = (torch.tensor(out.logprobs) - expected).abs().max().item()
            assert gap < 1e-4, (step, out.versions, gap)
            if len(set(out.versions)) > 1:
                spanning += 1
                first, second = sorted(set(out.versions))[:2]
                assert (per_version[first] - per_version[second]).abs().max() > 1e-3
    return spanning


@pytest.mark.ray
def test_rollouts_span_versions_with_each_tokens_own_logprobs(ray_cluster, long_ckpts, tmp_path, early_reward):
    """Lag 2, one engine, MTP speculation, 320-token rollouts: generation takes longer than an update, so the
    engine is generating whenever a refit comes, and takes it mid-rollout.

    - some steps hold rollouts whose tokens span two versions; each rollout's versions never decrease, the logged
      `rollout_version_span_max` / `rollout_versions_mean` are those of the recorded versions, and `policy_lag` is
      the trainer's version minus the oldest token's, at most 2;
    - every token's behaviour log-prob equals a full forward of the trainer's weights at that token's version over
      prompt + completion, within 1e-4 (fp32 on both sides with the weights sent unchanged, so they differ only in
      summation order, ~1e-6; the bound leaves room for any thread count and instruction set). Each spanning
      rollout also has a token whose log-prob under the other version differs by more than 1e-3, so a token
      sampled by the wrong weights would be caught;
    - the senders' wait at a refit (`weight_sync_wait_s`) is under a quarter of the shortest generation: an
      in-flight refit waits for one decoding step (a few ms here, against generations of 1-3 s), where it used to
      wait for the generations queued before it."""
    cfg = ray_cfg(long_ckpts, tmp_path, "disaggregated", lag=2, steps=STEPS)
    cfg.backend.in_flight_updates = True
    cfg.grpo.max_tokens = MAX_TOKENS
    trainer, metrics = run(cfg)
    for step, m in enumerate(metrics):
        outs = trainer.recorded[step][1]
        assert m["rollout_versions_mean"] == pytest.approx(sum(len(set(o.versions)) for o in outs) / len(outs))
        assert m["policy_lag"] == step - min(min(o.versions) for o in outs) <= 2
    spanning = spanning_rollouts(cfg, trainer, metrics)
    assert spanning > 0 and max(m["rollout_version_span_max"] for m in metrics) >= 2
    shortest = min(m["engine_generate_s"] for m in metrics)
    assert max(m["weight_sync_wait_s"] for m in metrics) < shortest / 4, \
        [(m["weight_sync_wait_s"], m["engine_generate_s"]) for m in metrics]
