"""The drafter registry: a new method added by one `register` call runs in the engine, and every list of method
names the configs and command lines accept is the registry's."""

import argparse

import pytest

from megatron_spec.cli import build_parser
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.drafters.proposer import Drafts, Proposer
from megatron_spec.drafters.registry import (DrafterMethod, drafter_method, method_names, register, sim_drafter,
                                             sim_names, unregister)
from megatron_spec.sim.config import Speculation

PROMPTS = [[40] * 6, [5, 6, 7, 5, 6, 7], [3], [20, 21, 20, 21, 20], [8, 9, 10, 11]]
K, MAX_TOKENS = 3, 24


class RepeatLast(Proposer):
    """A toy drafter: k copies of the sequence's last token (capped, like every proposer, so that accepted drafts
    plus the bonus token never pass max_tokens)."""

    def propose(self, seqs, k: int) -> Drafts:
        return Drafts([[s.tokens[-1]] * min(k, s.remaining - 1) for s in seqs])


@pytest.fixture
def repeat_last():
    """Registers the toy method for one test and removes it after, so no other test sees it."""
    register(DrafterMethod("repeat_last", lambda spec, target, drafter: RepeatLast()))
    yield "repeat_last"
    unregister("repeat_last")


def expected_stats(prompt: list[int], out: list[int], k: int, max_tokens: int) -> tuple[int, int, int]:
    """(drafted, accepted, verify steps) that RepeatLast must produce under greedy verification, replayed from the
    plain greedy output: after the prefill token, each step drafts d = min(k, remaining - 1) copies of the last
    token, accepts the leading drafts equal to the next greedy tokens, and emits those plus one; d = 0 is a plain
    step (no verify step counted)."""
    drafted = accepted = steps = 0
    i = 1
    while i < len(out):
        last = (prompt + out[:i])[-1]
        d = min(k, max_tokens - i - 1)
        n = 0
        while n < d and i + n < len(out) and out[i + n] == last:
            n += 1
        if d:
            drafted, accepted, steps = drafted + d, accepted + n, steps + 1
        i += n + 1
    return drafted, accepted, steps


def test_a_method_added_through_the_registry_alone_runs_in_the_engine(tiny_model, repeat_last):
    """Greedy output with the toy drafter equals plain greedy output token for token (losslessness needs nothing
    from the drafter), and its drafted / accepted / verify-step counts are exactly those its design implies,
    replayed from the plain output. The prompts repeat tokens, so some drafts are accepted and some rejected: the
    replay is checked on both paths."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    plain = LLMEngine(tiny_model, max_num_seqs=2).generate(PROMPTS, params)
    fast = LLMEngine(tiny_model, max_num_seqs=2, spec=SpecConfig(repeat_last, K)).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    totals = [0, 0]
    for prompt, p, f in zip(PROMPTS, plain, fast):
        drafted, accepted, steps = expected_stats(prompt, p.token_ids, K, MAX_TOKENS)
        assert (f.spec.get("drafted", 0), f.spec.get("accepted", 0), f.spec.get("verify_steps", 0)) == (
            drafted, accepted, steps)
        totals = [totals[0] + drafted, totals[1] + accepted]
    assert 0 < totals[1] < totals[0]


def test_the_toy_method_is_gone_after_its_test():
    assert "repeat_last" not in method_names()
    with pytest.raises(ValueError, match="unknown speculative method 'repeat_last'"):
        SpecConfig("repeat_last")


def test_registering_a_name_twice_or_an_inconsistent_entry_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register(DrafterMethod("ngram", lambda spec, target, drafter: RepeatLast()))
    with pytest.raises(ValueError, match="`load` must be given"):
        DrafterMethod("x", lambda spec, target, drafter: None, needs_weights=True)
    with pytest.raises(ValueError, match="online loss needs a drafter with weights"):
        DrafterMethod("x", lambda spec, target, drafter: None, online_loss=lambda *a: [])
    with pytest.raises(ValueError, match="`module` must be given"):
        DrafterMethod("x", lambda spec, target, drafter: None, needs_weights=True, load=lambda *a: None)


def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_method_list_is_the_registry():
    """The config accepts exactly the registered names; `train-drafter --method` offers exactly the trainable
    ones; the benchmarks measure every registered drafter by default; each entry's vLLM name and simulator
    profile are ones those consumers know."""
    names = method_names()
    assert set(names) == {"draft_model", "mtp", "eagle3", "ngram", "history"}
    for name in names:
        assert SpecConfig(name).method == name
    with pytest.raises(ValueError, match=", ".join(names)):
        SpecConfig("medusa")
    parser = build_parser()
    assert list(option(sub(parser, "train-drafter"), "--method").choices) == list(method_names(trainable=True))
    assert set(method_names(trainable=True)) == set(method_names(weights=True))
    for bench in ("rollout", "step"):
        assert option(sub(sub(parser, "bench"), bench), "--drafters").default == list(names)
    for name in names:
        m = drafter_method(name)
        assert sim_drafter(m.sim_label) is m
        assert Speculation(k=2, acceptance_length=2.0, drafter=m.sim_label, draft_model="tiny-draft").drafter == m.sim_label
        spec = SpecConfig(name, 2, model="d" if m.needs_weights else None)
        assert spec.vllm() == (None if m.vllm_method is None else {**spec.vllm(), "method": m.vllm_method})
    assert SpecConfig("ngram", 2).vllm() == {"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert SpecConfig("history", 2, prompt_lookup_max=3).vllm() == {
        "method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 5}
    assert method_names(vllm=True) == ("draft_model", "mtp", "eagle3", "ngram", "history")
    assert sim_names() == ("model", "mtp", "eagle3", "ngram", "history")


def test_vllm_problem_names_the_missing_extra(monkeypatch):
    """A method whose vLLM counterpart imports a package this machine lacks is refused by the config check with the
    extra that installs it (the launch check asks the same); one without a counterpart says so; the others pass.
    The package is hidden by making `find_spec` miss it, so the test holds whether or not it is installed."""
    import importlib.util

    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import config_problems
    from megatron_spec.rl.overrides import apply_overrides
    from megatron_spec.drafters.registry import vllm_problem

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "arctic_inference"
                        else real(name, *a))
    assert "pip install 'megatron-spec[suffix]'" in vllm_problem("history")
    assert vllm_problem("ngram") is None and vllm_problem("mtp") is None
    cfg = apply_overrides(RLConfig(), ["backend.generator=vllm", "spec.method=history", "spec.adaptive=false"])
    assert any("megatron-spec[suffix]" in p for p in config_problems(cfg))
    embedded = apply_overrides(RLConfig(), ["spec.method=history", "spec.adaptive=false"])
    assert not any("suffix" in p for p in config_problems(embedded))
    register(DrafterMethod("toy_plain", lambda spec, target, drafter: Proposer()))
    try:
        assert "'toy_plain' has no vLLM counterpart" in vllm_problem("toy_plain")
    finally:
        unregister("toy_plain")
