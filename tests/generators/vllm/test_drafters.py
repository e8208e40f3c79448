"""Our drafters serve in vLLM unchanged: the shipped tiny Qwen3 with its MTP head (through our vLLM plugin's class)
and its EAGLE-3 head (exported to vLLM's Eagle3Qwen3 layout), each in one engine for the module.

- Greedy identity: vLLM with our drafter == our engine with it == our plain engine.
- Acceptance: on the same target, head and prompts, vLLM's greedy acceptance length is our engine's within 2 %.
- MTP refit: a stale drafter loses acceptance; a drafter refit restores it exactly; without the drafter refit
  (target-only refit, the negative control) it stays low. CPU sleep / wake keeps the drafter.
"""

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.rl.task import PromptTask
from megatron_spec.drafters.config import SpecConfig

from .common import acceptance_length, stream, vllm_only

pytestmark = vllm_only

POLICY = "checkpoints/tiny-qwen3"
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def target():
    return from_pretrained(POLICY)


@pytest.fixture(scope="module")
def prompts():
    task = PromptTask.build("tiny", POLICY, 64, 0, "eval")
    return [task.encode(p) for p in task.problems(0, 32)]


def start(tmp_path_factory, target, kind: str, path: str):
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_drafter, export_target

    drafter = load_drafter(path, target.config)
    root = tmp_path_factory.mktemp(f"vllm_{kind}")
    export_target(target, root / "policy")
    export_drafter(drafter, root / "drafter")
    gen = VLLMGenerator(str(root / "policy"), SpecConfig(kind, K, model=str(root / "drafter")), drafter=drafter,
                        max_model_len=512)
    return gen, drafter


@pytest.fixture(scope="module")
def mtp(tmp_path_factory, target):
    gen, drafter = start(tmp_path_factory, target, "mtp", "checkpoints/tiny-qwen3-mtp")
    yield gen, drafter
    gen.close()


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory, target):
    gen, drafter = start(tmp_path_factory, target, "eagle3", "checkpoints/tiny-qwen3-eagle3")
    yield gen, drafter
    gen.close()


def ours(target, drafter, kind, prompts):
    return LLMEngine(target, spec=SpecConfig(kind, K), drafter=drafter).generate(prompts, GREEDY)


def emitted_per_verify_step(outs) -> float:
    """Tokens returned per verify step (the prefill's first token excluded): the acceptance length counted on the
    tokens a caller gets. Our engine's own `accepted` also counts drafts accepted in a completion's last verify step
    *after* its stop token (then cut off); vLLM's output stops at the stop token, so its counters cannot see them.
    Counted on returned tokens, both engines are measured alike."""
    return sum(len(o.token_ids) - 1 for o in outs) / sum(o.spec["verify_steps"] for o in outs)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_greedy_identity_and_acceptance_within_2_percent(request, target, prompts, kind):
    """32 arithmetic prompts, greedy, up to 64 tokens: identical tokens everywhere; vLLM's verify steps and
    acceptance length (tokens per verify step, counted on returned tokens for both engines) within 2 % of ours.
    Both verify greedily against the same target, so equal drafts give equal acceptance; the 2 % allows drafts
    formed differently at the edges (vLLM's draft KV cache is written by its own kernels)."""
    gen, drafter = request.getfixturevalue(kind)
    plain = LLMEngine(target).generate(prompts, GREEDY)
    mine = ours(target, drafter, kind, prompts)
    theirs = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in plain] == [o.token_ids for o in mine]
    steps_ours = sum(o.spec["verify_steps"] for o in mine)
    steps_vllm = sum(o.spec["verify_steps"] for o in theirs)
    assert abs(steps_vllm - steps_ours) <= 0.02 * steps_ours, (steps_ours, steps_vllm)
    a_ours, a_vllm = emitted_per_verify_step(mine), emitted_per_verify_step(theirs)
    assert a_vllm > 2.5  # the trained drafter really drafts in vLLM
    assert abs(a_vllm - a_ours) <= 0.02 * a_ours, (a_ours, a_vllm)


def test_mtp_drafter_refit_restores_acceptance(target, prompts, mtp):
    """Stale drafter (re-initialised weights) -> acceptance near 1; target-only refit (negative control) leaves it
    there; refitting the trained drafter restores exactly the fresh engine's acceptance (greedy is deterministic).
    Then a CPU sleep / wake keeps it (vLLM has no CPU sleep mode; the drafter is never lost)."""
    gen, drafter = mtp
    fresh = acceptance_length(gen.generate(prompts, GREEDY))
    stale = load_drafter("checkpoints/tiny-qwen3-mtp", target.config)
    torch.manual_seed(0)
    stale.reset_parameters()
    gen.update_weights(stream(target, stale))
    low = acceptance_length(gen.generate(prompts, GREEDY))
    gen.update_weights(stream(target))
    still_low = acceptance_length(gen.generate(prompts, GREEDY))
    gen.update_weights(stream(target, drafter))
    restored = acceptance_length(gen.generate(prompts, GREEDY))
    gen.sleep()
    gen.wake()
    after_sleep = acceptance_length(gen.generate(prompts, GREEDY))
    assert low < 1.3 < 2.5 < fresh, (low, fresh)
    assert still_low == low
    assert restored == fresh == after_sleep
