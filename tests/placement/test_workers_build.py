"""What each Ray actor loads: with a Megatron trainer no actor holds the whole policy (every trainer rank reads its
own shards; a vLLM engine starts from the checkpoint files in their own dtype); our engine, which is not sharded,
loads the policy itself. The builders are replaced by recorders, so the test sees exactly what `_build` passes."""

import pytest

from megatron_spec.placement import workers
from megatron_spec.rl.config import RLConfig


@pytest.fixture
def calls(monkeypatch):
    seen = []
    loaded = object()

    def record(kind):
        return lambda cfg, model, drafter: seen.append((kind, model, drafter)) or kind

    def load(path, *args, **kwargs):
        seen.append(("from_pretrained", path, kwargs.get("dtype")))
        return loaded

    monkeypatch.setattr("megatron_spec.rl.backends.build_policy", record("policy"))
    monkeypatch.setattr("megatron_spec.rl.backends.build_generator", record("generator"))
    monkeypatch.setattr("megatron_spec.models.from_pretrained", load)
    monkeypatch.setattr("megatron_spec.rl.loop.load_drafter_for", lambda cfg, model: "drafter")
    return seen, loaded


@pytest.mark.parametrize("which", ["policy", "generator"])
def test_megatron_trainer_with_vllm_loads_no_whole_policy_anywhere(calls, which):
    seen, _ = calls
    cfg = RLConfig()
    cfg.backend.trainer, cfg.backend.generator = "megatron", "vllm"
    assert workers._build(cfg, which) == which
    assert seen == [(which, None, None)]


def test_megatron_trainer_with_our_engine_loads_it_in_the_engine_only(calls):
    seen, loaded = calls
    cfg = RLConfig()
    cfg.backend.trainer, cfg.backend.generator = "megatron", "embedded"
    workers._build(cfg, "policy")
    workers._build(cfg, "generator")
    assert seen == [("policy", None, None), ("from_pretrained", cfg.model.policy, None),
                    ("generator", loaded, "drafter")]


def test_embedded_trainer_loads_the_policy_it_trains(calls):
    seen, loaded = calls
    cfg = RLConfig()
    workers._build(cfg, "policy")
    assert seen == [("from_pretrained", cfg.model.policy, None), ("policy", loaded, "drafter")]
