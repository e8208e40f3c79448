"""The one causal-mask convention of the package: a boolean mask is True where a query may attend to a key.

Our attention (`layers.attend`, the KV cache's masks, the shared-prompt passes of `rl/prefix.py`) reads masks this
way. Megatron-Core reads the opposite (True = masked out); the Megatron backend passes `~causal_mask(...)` at the
one place it hands a mask over (`trainers/megatron/forward.py`), so the inversion is written once, where it is due.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(n: int, device: torch.device | str | None = None) -> Tensor:
    """[1, 1, n, n] boolean lower triangle: query t may attend to keys 0..t."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
