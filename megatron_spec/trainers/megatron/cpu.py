"""Megatron-Core on a machine without CUDA: lets a model build, run forward / backward and go through Megatron's
pipeline schedules on CPU.

megatron-core 0.16 reaches for CUDA in places that do not change the math:
- building with PP > 1 and MTP layers or tied embeddings: the last stage's copy of the embedding is synced with
  `weight.data.cuda()` before an all-reduce;
- forward: the rotary embedding and the MoE router move tensors to `torch.cuda.current_device()`, and core
  attention forks the CUDA RNG tracker (for dropout, which is 0 here). Callers also pass an explicit attention
  mask (`forward.attention_mask`), since the default one is made on "cuda";
- the schedules (`get_forward_backward_func`) count tokens in `torch.zeros(..., device="cuda")` and the
  pipeline's point-to-point exchange allocates its receive buffers on `torch.cuda.current_device()` and may call
  `torch.cuda.synchronize()`.
- activation recompute (`recompute_granularity`) saves and restores the CUDA RNG state around each recomputed
  part (for dropout, which is 0 here).
Inside `on_cpu()` those point at the CPU: `current_device` is "cpu", `Tensor.cuda` and `synchronize` do nothing,
the CUDA RNG state recompute saves is empty, and a torch function mode rewrites an explicit `device="cuda"` of a tensor factory to the CPU. Where CUDA exists it
does nothing.

It patches process-global state while active: `build_model` uses it only while constructing a model on a machine
without CUDA; forward passes and train steps on CPU wrap themselves in it. Numbers on a GPU come from the GPU tests.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from . import require_megatron

require_megatron()
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda" if isinstance(device, (str, torch.device)) else False


class _CudaToCpu(TorchFunctionMode):
    """Any torch call given `device="cuda..."` gets the CPU instead (tensor factories inside Megatron-Core)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_cpu():
    if torch.cuda.is_available():
        yield
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, torch.Tensor.cuda, tracker.fork, torch.cuda.synchronize
    saved_rng = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda, tracker.fork, torch.cuda.synchronize = saved
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_rng
