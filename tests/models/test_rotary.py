"""The engine's rotary table (`layers.rotary` through a `BatchView`) against the per-forward `rope_cos_sin`."""

import pytest
import torch

from megatron_spec.models.kv_cache import KVCache
from megatron_spec.models.layers import rope_cos_sin, rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,theta", [(32, 10000.0), (64, 100000.0), (128, 1000000.0)])
def test_table_rows_are_the_per_forward_values(head_dim, theta, dtype):
    """Bit for bit, for the head sizes of the shipped and supported models (multiples of 16), at ragged starts and
    T = 1 and 4 (a decode and a verify): a row read from the table is the same products and the same cos / sin as
    one computed per forward. Equality is the bound because greedy speculative decoding, whose first step after a
    plain one may mix rows from different forwards, is held to token identity. A table read one row off, or built
    with the halves laid out otherwise, fails at every row but position 0."""
    cache = KVCache(1, 8, 700, 1, head_dim, dtype)
    for starts, T in (([0, 5, 17, 99], 1), ([3, 250, 600, 40, 41], 4), ([695], 4)):
        view = cache.view(list(range(len(starts))), starts, T)
        with torch.inference_mode():
            got = rotary(view.positions, head_dim, theta, dtype, view)
        want = rope_cos_sin(view.positions, head_dim, theta, dtype)
        assert got[0].shape == want[0].shape == (len(starts), 1, T, head_dim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_without_the_engine_cache_it_is_rope_cos_sin():
    """Training's forwards (no cache) compute per forward: positions past any table still work."""
    positions = torch.tensor([[5000, 5001]])
    got = rotary(positions, 32, 10000.0, torch.float32, None)
    want = rope_cos_sin(positions, 32, 10000.0, torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
