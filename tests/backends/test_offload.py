"""A colocated trainer's offload (`megatron_spec.backends.offload`) on the embedded policy, on a CPU: the
optimizer states come back bit for bit and training continues exactly as without the offload, and the trainer's
logged resident memory falls while offloaded by about the gradients it freed (on a CPU the states already live in
host memory, so the gradients and the trimmed heap are what is released)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_spec.backends.offload import device_bytes, offload, onload
from megatron_spec.models import CausalLM, preset
from megatron_spec.rl.config import GRPOSection
from megatron_spec.rl.policy import Batch, EmbeddedPolicy

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def make_policy() -> EmbeddedPolicy:
    """tiny-qwen3 with a 32 k vocabulary: 9 M parameters, so 36 MB of gradients, well above the resident set's
    noise."""
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(preset("tiny-qwen3"), vocab_size=32768))
    return EmbeddedPolicy(model, GRPOSection(lr=1e-3, micro_batch_tokens=4096), SAMPLING)


def batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32768, (8, 24), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    return Batch(ids, mask, advantages=torch.randn(8, generator=g))


def states(policy) -> dict:
    return {(i, k): v.clone() for i, s in enumerate(policy.opt.state.values()) for k, v in s.items()}


def test_offload_round_trip_is_exact_and_training_continues_as_without():
    """Policy A: step, offload, onload, step; policy B (same seed): step, step. The Adam states after onload are
    bit for bit those before the offload, the gradients were freed in between, and after the second step both
    policies' weights and states are equal bit for bit (a lost or stale state would change the update)."""
    a, b = make_policy(), make_policy()
    for p in (a, b):
        p.train_step(batch(0))
    kept = states(a)
    offload(a)
    assert all(p.grad is None for p in a.model.parameters())
    onload(a)
    got = states(a)
    assert kept.keys() == got.keys() and all(torch.equal(kept[k], got[k]) for k in kept)
    a.train_step(batch(1))
    b.train_step(batch(1))
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), n
    sa, sb = states(a), states(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_logged_memory_falls_while_offloaded():
    """The metrics `offload` logs (rl.memory's resident set before and after): the resident set falls by at
    least 80 % of the 36 MB of gradients it freed (the rest of the drop, or a little less, is the heap that
    malloc_trim returns or keeps), and nothing lives on an accelerator on a CPU run. Onload puts nothing back
    into memory that the next step would not allocate itself, so the resident set stays down."""
    policy = make_policy()
    policy.train_step(batch(0))
    grads = sum(p.grad.numel() * 4 for p in policy.model.parameters() if p.grad is not None)
    assert grads > 30e6
    m = offload(policy)
    assert m["offload_freed_grad_mb"] == pytest.approx(grads / 2**20)
    assert m["offload_moved_mb"] == 0 and device_bytes(policy) == 0
    fall = m["trainer_rss_mb_before_offload"] - m["trainer_rss_mb_offloaded"]
    assert fall > 0.8 * m["offload_freed_grad_mb"], m
    assert offload(policy) == m  # a second offload changes nothing
    back = onload(policy)
    assert back["trainer_rss_mb_onloaded"] < m["trainer_rss_mb_before_offload"] - 0.5 * m["offload_freed_grad_mb"]
    assert onload(policy) == {}
