"""`refit.tensor_set_key`: what tells a weight-update group's sender that the tensor set changed between refits
(so it resends the headers): names, shapes and dtypes, never values."""

import torch
from torch import nn

from megatron_spec.refit import tensor_set_key


def test_the_key_follows_the_set_not_the_values():
    """New values keep the key; a drafter added or removed, a reshaped tensor, a new dtype or a renamed tensor each
    change it; the same modules in another order are another stream, so another key."""
    policy, drafter = nn.Linear(4, 3), nn.Linear(3, 2, bias=False)
    base = tensor_set_key(policy, None)
    with torch.no_grad():
        policy.weight.add_(1.0)
    assert tensor_set_key(policy, None) == base
    with_drafter = tensor_set_key(policy, drafter)
    assert with_drafter != base and with_drafter[:len(base)] == base and len(with_drafter) == len(base) + 1
    assert with_drafter[-1] == (1, "weight", (2, 3), "torch.float32")
    assert tensor_set_key(policy, None) == base  # the drafter removed again
    assert tensor_set_key(drafter, policy) != with_drafter
    assert tensor_set_key(nn.Linear(4, 5), None) != base
    assert tensor_set_key(nn.Linear(4, 3).to(torch.bfloat16), None) != base
    renamed = nn.Sequential(nn.Linear(4, 3))
    assert tensor_set_key(renamed, None) != base
