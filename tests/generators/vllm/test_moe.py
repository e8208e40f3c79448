"""Qwen3-MoE targets in vLLM.

- Plain decoding: the exported random tiny MoE model generates our engine's greedy tokens, and its sampled log-probs
  are our model's processed log-probs. Guards the export (`torch_dtype`, the MoE config fields) and vLLM's fp32
  expert kernels on CPU; vLLM loading such a model in bf16 is off by far more.
- MTP drafter of a MoE target (our `MegatronSpecMTP` building vLLM's Qwen3-MoE decoder layer): greedy identity and
  acceptance within 2 % of our engine, and a drafter refit that changes the head changes vLLM's drafts as it changes
  ours, with the MoE target refit alongside (the CPU expert repack in worker.py)."""

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import CausalLM, preset
from megatron_spec.speculative.sampling import processed_logprobs

from .common import stream, vllm_only

pytestmark = vllm_only

PROMPTS = [[1, 20, 21, 22, 15, 3], [1, 30, 31, 5, 7], [1, 9, 9, 8]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target

    torch.manual_seed(3)
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    model.reset_parameters(std=0.15)
    path = export_target(model, tmp_path_factory.mktemp("vllm_moe") / "moe")
    gen = VLLMGenerator(str(path), max_model_len=256)
    yield model, gen
    gen.close()


def test_moe_greedy_and_logprobs(moe):
    """Greedy: token-for-token our engine's (wide argmax margins at std 0.15). Sampled at T=1: each returned
    log-prob within 1e-4 of our teacher-forced processed log-prob (fp32 both sides; measured ~2e-6)."""
    model, gen = moe
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in gen.generate(PROMPTS, greedy)] == \
        [o.token_ids for o in LLMEngine(model).generate(PROMPTS, greedy)]
    for prompt, out in zip(PROMPTS, gen.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, seed=2))):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1 : -1]
        ref = processed_logprobs(logits, 1.0).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)


# --- The MTP drafter of a Qwen3-MoE target (our `MegatronSpecMTP` with vLLM's Qwen3-MoE decoder layer) ----------
# The shipped tiny Qwen3-MoE and its trained MTP head: a trained head is what makes acceptance a real measurement
# (a random head's acceptance length sits near 1, where a 2 % bound says little).

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def mtp_prompts():
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(2, 64, (5,), generator=g).tolist() for _ in range(16)]


@pytest.fixture(scope="module")
def moe_mtp(tmp_path_factory):
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_drafter, export_target
    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.drafters.config import SpecConfig

    target = from_pretrained("checkpoints/tiny-qwen3-moe")
    head = load_drafter("checkpoints/tiny-qwen3-moe-mtp", target.config)
    root = tmp_path_factory.mktemp("vllm_moe_mtp")
    export_target(target, root / "policy")
    export_drafter(head, root / "mtp")
    gen = VLLMGenerator(str(root / "policy"), SpecConfig("mtp", K, model=str(root / "mtp")), drafter=head,
                        max_model_len=256)
    yield target, head, gen
    gen.close()


def ours(target, head, prompts):
    from megatron_spec.drafters.config import SpecConfig

    return LLMEngine(target, spec=SpecConfig("mtp", K), drafter=head).generate(prompts, GREEDY)


def verify_steps(outs) -> int:
    return sum(o.spec["verify_steps"] for o in outs)


def emitted_per_verify_step(outs) -> float:
    """Tokens returned per verify step, the prefill's token excluded (as in test_drafters.py: counted on returned
    tokens, both engines are measured alike; here EOS is ignored, so nothing is cut off anyway)."""
    return sum(len(o.token_ids) - 1 for o in outs) / verify_steps(outs)


def close(ours_outs, vllm_outs) -> None:
    """Same tokens; verify steps and acceptance length within 2 % (both verify greedily against the same target, so
    equal drafts give equal steps; 2 % allows drafts that flip where the MTP layer's top two logits nearly tie,
    since vLLM's attention and fused-expert kernels sum in another order than ours)."""
    assert [o.token_ids for o in vllm_outs] == [o.token_ids for o in ours_outs]
    s_ours, s_vllm = verify_steps(ours_outs), verify_steps(vllm_outs)
    assert abs(s_vllm - s_ours) <= 0.02 * s_ours, (s_ours, s_vllm)
    a_ours, a_vllm = emitted_per_verify_step(ours_outs), emitted_per_verify_step(vllm_outs)
    assert abs(a_vllm - a_ours) <= 0.02 * a_ours, (a_ours, a_vllm)


def test_moe_mtp_greedy_identity_and_acceptance(moe_mtp):
    """16 random prompts, 48 greedy tokens each, k=3: vLLM with our MTP class (Qwen3-MoE decoder layer, experts
    loaded from our naming) returns our plain engine's tokens and our MTP engine's, with verify steps and acceptance
    length within 2 % of ours. Acceptance above 1.5 (ours measures 1.96) shows the head really drafts in vLLM: a head
    re-initialised in the test measures about 1.15."""
    target, head, gen = moe_mtp
    prompts = mtp_prompts()
    mine, theirs = ours(target, head, prompts), gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in mine] == [o.token_ids for o in LLMEngine(target).generate(prompts, GREEDY)]
    close(mine, theirs)
    assert emitted_per_verify_step(theirs) > 1.5


def test_moe_mtp_refit_drafts_with_the_new_head(moe_mtp):
    """`update_weights` with a changed MTP head (re-initialised: experts, router, attention, norms all new) under
    `drafter.`: vLLM then matches our engine run with that head (tokens, steps and acceptance within 2 %), which is
    far below the trained head's; refitting the trained head restores exactly the fresh engine's figures (greedy
    is deterministic). The target is refit too each time, so the MoE target's reload path (the CPU expert repack in
    worker.py) is covered: without it the target's MoE layers compute garbage after a refit and tokens differ."""
    from megatron_spec.drafters.files import load_drafter

    target, head, gen = moe_mtp
    prompts = mtp_prompts()
    fresh = gen.generate(prompts, GREEDY)
    changed = load_drafter("checkpoints/tiny-qwen3-moe-mtp", target.config)
    torch.manual_seed(0)
    changed.reset_parameters()
    gen.update_weights(stream(target, changed))
    after = gen.generate(prompts, GREEDY)
    close(ours(target, changed, prompts), after)
    assert emitted_per_verify_step(after) < emitted_per_verify_step(fresh) - 0.3
    gen.update_weights(stream(target, head))
    restored = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in restored] == [o.token_ids for o in fresh]
    assert verify_steps(restored) == verify_steps(fresh)


def test_export_refuses_an_mtp_layer_vllm_would_build_of_another_kind(tmp_path):
    """decoder_sparse_step=2 on 4 layers: the trunk's last layer (3) is MoE, vLLM's MTP layer 4 would be dense; the
    export raises before any engine starts, and writes nothing."""
    import dataclasses

    from megatron_spec.generators.vllm.export import export_drafter
    from megatron_spec.drafters.mtp.model import MTP

    cfg = dataclasses.replace(preset("tiny-qwen3-moe"), decoder_sparse_step=2)
    with pytest.raises(NotImplementedError, match="another kind"):
        export_drafter(MTP(cfg), tmp_path / "mtp")
    assert not (tmp_path / "mtp").exists()
