"""`attend_unrolled` is `attend` with the unrolled steps' mask, written out: causal over step 0's keys, the diagonal
of every later step's."""

import pytest
import torch

from megatron_spec.models.layers import attend, attend_unrolled
from megatron_spec.models.masks import causal_mask


def unrolled_mask(n: int, later: int) -> torch.Tensor:
    """[1, 1, n, (later + 1) n]: row t sees step 0's keys 0..t and row t of each later step, built from the rule."""
    rows = torch.arange(n)[:, None]
    cols = torch.arange((later + 1) * n)[None]
    step, key = cols // n, cols % n
    return torch.where(step == 0, key <= rows, key == rows)[None, None]


@pytest.mark.parametrize("later", [0, 1, 2, 3])
def test_unrolled_attention_is_attention_under_the_unrolled_mask(later):
    """Grouped queries (4 heads on 2 KV heads) of step `later` over steps 0..later, each step's keys longer than
    its queries (earlier steps cover more positions; only the first n are read). Output and the gradients of q and
    every step's k and v match `attend` over the concatenated keys with the mask built independently here.

    Tolerance: the two compute the same sums in a different order (a softmax over n + s against (s + 1) n terms,
    of which the extra ones are exact zeros, and one matmul against a matmul plus s products). In fp32 with at most
    4 n = 48 terms a sum, that is a few 1e-6 at worst relative to values of order 1, whatever the CPU's vector
    width. Attending a later step causally, or another row of it, moves outputs by ~0.1 (checked: the diagonal
    replaced by a lower triangle fails)."""
    torch.manual_seed(later)
    B, H, KV, n, D = 2, 4, 2, 12, 8
    q = torch.randn(B, H, n, D, requires_grad=True)
    keys = [torch.randn(B, KV, n + 3 - j, D, requires_grad=True) for j in range(later + 1)]
    values = [torch.randn(B, KV, n + 3 - j, D, requires_grad=True) for j in range(later + 1)]
    up = torch.randn(B, H, n, D)

    got = attend_unrolled(q, keys, values)
    grads_got = torch.autograd.grad((got * up).sum(), [q, *keys, *values])
    k = torch.cat([x[:, :, :n] for x in keys], 2)
    v = torch.cat([x[:, :, :n] for x in values], 2)
    want = attend(q, k, v, unrolled_mask(n, later))
    grads_want = torch.autograd.grad((want * up).sum(), [q, *keys, *values])

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_the_mask_builder_agrees_with_the_causal_mask():
    """The reference mask's step 0 block is the package's causal mask (so the test above is anchored to it)."""
    assert torch.equal(unrolled_mask(5, 2)[..., :5], causal_mask(5))
    assert torch.equal(unrolled_mask(5, 2)[0, 0, :, 5:10], torch.eye(5, dtype=torch.bool))
