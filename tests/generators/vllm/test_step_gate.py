"""The whole-step gate on vLLM engines: `speculation(False)` makes a `generate` call a plain engine's, and
speculation comes back after it, lossless on both sides of each switch.

Engines (each started once): plain, `draft_model` (a model drafter: the one whose skipped forward is the cost the
gate saves) and `history` (vLLM's suffix decoding, which refuses any k but its own, where the extra installs).
"""

import pytest

from megatron_spec.drafters.config import SpecConfig
from megatron_spec.engine import SamplingParams

from .common import HAVE_SUFFIX, perturbed, random_qwen3, suffix_only, vllm_only

pytestmark = vllm_only

PROMPTS = [[1, 20, 21, 22, 15, 3], [1, 30, 31, 5, 7], [1, 9, 9, 8], [1, 40, 41, 42, 43, 44, 45, 46]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target

    root = tmp_path_factory.mktemp("vllm_gate")
    target = random_qwen3(0)
    draft = perturbed(target, seed=2, scale=0.05)
    export_target(target, root / "target")
    export_target(draft, root / "draft")
    made = {"plain": VLLMGenerator(str(root / "target"), max_model_len=256),
            "draft_model": VLLMGenerator(str(root / "target"), SpecConfig("draft_model", 3, model=str(root / "draft")),
                                         drafter=draft, max_model_len=256)}
    if HAVE_SUFFIX:
        made["history"] = VLLMGenerator(str(root / "target"), SpecConfig("history", 3), max_model_len=256)
    yield made
    for g in made.values():
        g.close()


@pytest.mark.parametrize("method", ["draft_model", pytest.param("history", marks=suffix_only)])
def test_gate_switches_speculation_off_and_back_losslessly(engines, method):
    """speculative -> plain -> speculative: every call's greedy tokens equal plain vLLM's; the plain call reports
    no speculation (no verify step, every engine step emitted one token: `_Requests.take` would count a step that
    emitted more as accepted drafts, checked through a spec-free completion), and the calls either side of it
    accept drafts (draft_model: exactly as many)."""
    plain = [o.token_ids for o in engines["plain"].generate(PROMPTS, GREEDY)]
    gen = engines[method]
    before = gen.generate(PROMPTS, GREEDY)
    with gen.speculation(False):
        assert gen.speculating == 0
        off = gen.generate(PROMPTS, GREEDY)
    after = gen.generate(PROMPTS, GREEDY)
    for outs in (before, off, after):
        assert [o.token_ids for o in outs] == plain
    assert all(o.spec == {} for o in off)
    accepted = [sum(o.spec["accepted"] for o in outs) for outs in (before, after)]
    assert min(accepted) > 0
    if method == "draft_model":  # same greedy rollouts, same drafter: the same acceptance after the switch
        assert accepted[0] == accepted[1]
    # (suffix decoding also drafts from the responses it has seen, so its acceptance grows from call to call)


def test_plain_step_emits_one_token_per_engine_step(engines):
    """Inside `speculation(False)` no draft is verified: every engine step emits one token per request (40 tokens
    take 40 engine steps), where the speculative call around it takes fewer."""
    gen = engines["draft_model"]
    engine = gen.llm.llm_engine
    step, counted = engine.step, []

    def counting():
        counted[-1] += 1
        return step()

    engine.step = counting
    try:
        counted.append(0)
        with gen.speculation(False):
            gen.generate(PROMPTS[:1], GREEDY)
        counted.append(0)
        gen.generate(PROMPTS[:1], GREEDY)
    finally:
        del engine.step
    assert counted[0] == GREEDY.max_tokens
    assert counted[1] < GREEDY.max_tokens


def test_switch_refused_while_generating(engines):
    gen = engines["draft_model"]
    gen.running = object()  # a generate call in flight, as another thread would see it
    try:
        with pytest.raises(RuntimeError, match="while generate runs"):
            with gen.speculation(False):
                pass
    finally:
        gen.running = None
