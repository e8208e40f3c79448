"""Megatron-Core on a machine without CUDA: lets a model build and run forward / backward on CPU.

megatron-core 0.16 reaches for CUDA in places that do not change the math:
- building with PP > 1 and MTP layers or tied embeddings: the last stage's copy of the embedding is synced with
  `weight.data.cuda()` before an all-reduce;
- forward: the rotary embedding and the MoE router move tensors to `torch.cuda.current_device()`, and core
  attention forks the CUDA RNG tracker (for dropout, which is 0 here). Callers also pass an explicit attention
  mask (`forward.causal_mask`), since the default one is made on "cuda".
Inside `on_cpu()` those point at the CPU. Where CUDA exists it does nothing.

It patches process-global state while active: `build_model` uses it only while constructing a model on a machine
without CUDA; forward passes on CPU (CI tests) wrap themselves in it. Numbers on a GPU come from the GPU tests.
"""

from __future__ import annotations

import contextlib

import torch

from . import require_megatron

require_megatron()
from megatron.core import tensor_parallel  # noqa: E402


@contextlib.contextmanager
def on_cpu():
    if torch.cuda.is_available():
        yield
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, torch.Tensor.cuda, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda, tracker.fork = saved
