"""Every tensor the engine, its proposers, the verifier and the sampler make lives on the model's device, checked
on a CPU by `tests/device_guard.DeviceGuard` (its docstring says why a taint check and not the `meta` device)."""

import copy

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.models import CausalLM, preset
from megatron_spec.speculative import verify
from megatron_spec.drafters.config import SpecConfig

from ..device_guard import DeviceGuard

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [3], [20, 21, 20, 21, 20]]


def placed_model():
    """The tiny target and its drafters as a run places them: built, then moved with `.to(device)`."""
    torch.manual_seed(0)
    target = CausalLM(preset("tiny-qwen3")).eval()
    target.reset_parameters(std=0.15)
    target = target.to("cpu")
    return target, {"plain": (None, None), "ngram": (SpecConfig("ngram", 3), None),
                    "mtp": (SpecConfig("mtp", 3), MTP(target.config, MTPConfig(1)).to("cpu")),
                    "draft_model": (SpecConfig("draft_model", 3, draft_sampling=True), copy.deepcopy(target))}


@pytest.mark.parametrize("name", ["plain", "ngram", "mtp", "draft_model"])
def test_engine_makes_every_tensor_on_the_model_device(name):
    """Greedy and sampled generation (batch capacity 3 for 4 prompts: sequences join mid-flight) under the guard:
    no host tensor meets a device tensor, and the guard changes no token (same as an unguarded run)."""
    results = []
    for guarded in (True, False):
        with DeviceGuard() if guarded else torch.no_grad():
            target, drafters = placed_model()
            spec, drafter = drafters[name]
            engine = LLMEngine(target, max_num_seqs=3, spec=spec, drafter=drafter)
            results.append([[o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=12, seed=3, **kw))]
                            for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9))])
    assert results[0] == results[1]


def test_guard_catches_a_host_tensor_meeting_the_model():
    """The guard can fail: ids made without a device, and a module never moved to the device, are both caught at
    the model's forward; ids made with the model's device pass."""
    with DeviceGuard():
        target, _ = placed_model()
        target(torch.tensor([[1, 2, 3]], device=target.device))
        with pytest.raises(AssertionError, match="host tensor"):
            target(torch.tensor([[1, 2, 3]]))
        unplaced = CausalLM(preset("tiny-qwen3"))
        with pytest.raises(AssertionError, match="host tensor"):
            unplaced(torch.tensor([[1, 2, 3]], device=target.device))


def test_guard_catches_a_planted_verifier_bug(monkeypatch):
    """The verifier's draft-position index made without a device (as it once was) fails the guarded engine run."""
    def host_prefix(accept, draft_len):
        valid = torch.arange(accept.shape[1])[None] < draft_len[:, None]
        return (accept & valid).int().cumprod(-1).sum(-1)

    monkeypatch.setattr(verify, "accepted_prefix", host_prefix)
    with DeviceGuard() as guard:
        target, drafters = placed_model()
        engine = LLMEngine(target, spec=drafters["ngram"][0])
        with pytest.raises(AssertionError, match="host tensor"):
            engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert "verify.py" in guard.violations[0] or "engine.py" in guard.violations[0]
