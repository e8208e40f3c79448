"""Weight refit: the trainer streams `(hf_name, tensor)` pairs in size-bounded buckets; the generator loads them.

The same stream shape is what a vLLM backend consumes through `load_weights`, so the RL loop never cares which
generator it has. Drafter tensors travel in the same stream under the `drafter.` prefix every step, so a drafter
can never be silently lost or left stale across an engine sleep.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

DRAFTER_PREFIX = "drafter."


def named_weights(model: nn.Module, drafter: nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Policy tensors by HF name (tied heads once), then the drafter's under `drafter.`."""
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # a tied lm_head shares the embedding's storage
            continue
        seen.add(t.data_ptr())
        yield name, t
    if drafter is not None:
        for name, t in drafter.state_dict().items():
            yield DRAFTER_PREFIX + name, t


def tensor_set_key(*modules: nn.Module | None) -> tuple:
    """What decides the layout of a refit of `modules` (None: absent, e.g. no drafter) beyond bucket size and dtype:
    each one's tensors' names, shapes and dtypes, read without touching their values. Two refits with equal keys
    stream the same tensors in the same order; a weight-update group resends its headers when the key changes."""
    return tuple((i, name, tuple(t.shape), str(t.dtype)) for i, m in enumerate(modules) if m is not None
                 for name, t in m.state_dict(keep_vars=True).items()
                 if isinstance(t, torch.Tensor))  # Megatron's state holds extra states that are no tensors


def buckets(stream: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group the stream into lists of at most `max_bytes` (a single larger tensor travels alone)."""
    bucket, size = [], 0
    for name, t in stream:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def load_buckets(model: nn.Module, drafter: nn.Module | None, stream: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
    """Copy every streamed tensor into the generator's model / drafter in place; returns bytes loaded.

    Unknown names raise: a refit that silently skipped tensors is exactly the bug that leaves a stale drafter.
    """
    params = dict(model.state_dict())
    drafter_params = dict(drafter.state_dict()) if drafter is not None else {}
    loaded, total = set(), 0
    for bucket in stream:
        for name, t in bucket:
            if name.startswith(DRAFTER_PREFIX):
                dst = drafter_params.get(name[len(DRAFTER_PREFIX):])
            else:
                dst = params.get(name)
            if dst is None:
                raise KeyError(f"refit tensor {name!r} has no destination in the generator")
            dst.copy_(t)
            loaded.add(name)
            total += t.numel() * t.element_size()
    return total
