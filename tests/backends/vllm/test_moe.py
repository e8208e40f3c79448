"""A Qwen3-MoE target in vLLM (plain decoding): the exported random tiny MoE model generates our engine's greedy
tokens, and its sampled log-probs are our model's processed log-probs. Guards the export (`torch_dtype`, the MoE
config fields) and vLLM's fp32 expert kernels on CPU; vLLM loading such a model in bf16 is off by far more."""

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import CausalLM, preset
from megatron_spec.spec.sampling import processed_logprobs

from .common import vllm_only

pytestmark = vllm_only

PROMPTS = [[1, 20, 21, 22, 15, 3], [1, 30, 31, 5, 7], [1, 9, 9, 8]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megatron_spec.backends.vllm import VLLMGenerator
    from megatron_spec.backends.vllm.export import export_target

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
