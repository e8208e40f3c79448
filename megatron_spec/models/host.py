"""Tensors from Python lists, for the engine's hot path (token ids, positions, slots, uniforms).

`torch.tensor` converts a Python list element by element, ~0.27 us an element on a 2-core AVX2 EPYC: a [64, 4]
index tensor takes ~97 us, and a k = 3 step at 64 sequences builds about ten such tensors (about a tenth of the
step). numpy reads the same list ~4-6x faster, and torch then takes its buffer without a copy. The values are
the same: integers as int64, floats rounded to float32 as `torch.tensor` rounds them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def long_tensor(values, device: torch.device | str = "cpu") -> Tensor:
    """int64 tensor of `values`: a list of ints, a rectangular list of lists, or a numpy array."""
    return on(torch.from_numpy(np.asarray(values, dtype=np.int64)), device)


def float_tensor(values, device: torch.device | str = "cpu") -> Tensor:
    """float32 tensor of `values` (a list of floats or a rectangular list of lists)."""
    return on(torch.from_numpy(np.asarray(values, dtype=np.float32)), device)


def spans(starts: list[int], length: int, last: int, device: torch.device | str = "cpu") -> Tensor:
    """[B, length] int64: start, start + 1, ... for each of `starts`, clamped at `last` (padding past an end)."""
    return long_tensor(np.minimum(np.add.outer(np.asarray(starts), np.arange(length)), last), device)


def on(tensor: Tensor, device: torch.device | str) -> Tensor:
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)
