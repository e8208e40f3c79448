"""The package's one causal-mask convention (`models/masks.py`: True = may attend) against torch's own causal
attention: `attend` with `causal_mask` equals `scaled_dot_product_attention(is_causal=True)` to float32 rounding
(1e-6 on values of order 1: the two differ only in summation order), and the inverted mask the Megatron backend
hands over is exactly the strict upper triangle Megatron-Core masks out."""

import torch
import torch.nn.functional as F

from megatron_spec.models.layers import attend
from megatron_spec.models.masks import causal_mask


def test_causal_mask_is_sdpa_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    mask = causal_mask(7)
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == torch.bool
    ours = attend(q, k, v, mask.expand(2, 1, 7, 7))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6, rtol=0)


def test_megatron_convention_is_the_inverse():
    masked_out = ~causal_mask(5)
    assert torch.equal(masked_out[0, 0], torch.ones(5, 5, dtype=torch.bool).triu(1))
