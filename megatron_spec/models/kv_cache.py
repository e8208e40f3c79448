"""KV cache: one preallocated tensor pair with a slot per running sequence and per-sequence lengths.

A sequence owns one slot for its whole life. Its length lives with the sequence (not here), so rolling back
rejected speculative tokens is just lowering that number: the stale keys beyond it are masked out and later
overwritten. Extra "layers" beyond the model's hold drafter KV (MTP / EAGLE-3 heads attend too).
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor, nn

from .. import kernels
from .host import long_tensor, spans


KV_BLOCK = 16
"""Attention reads the cache up to the batch's longest position rounded up to a multiple of this (the extra keys
are masked out). A prefix that grew by one key every step gave the attention matmuls a new shape every step, and
bf16 matmuls go to oneDNN, which builds a kernel per shape: 30 layers' q.k^T at SmolLM2's shapes took 1.8 ms a
step with the length growing against 0.8 ms at a fixed one (2-core AVX-512 EPYC, `research/shape_costs.py`). fp32
goes to MKL, which has no such cost; there the rounding costs at most 15 keys of attention."""


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", first_layer: int = 0):
        self.first_layer = first_layer
        """Layer index stored at row 0 (a drafter's cache holds only its own layers, numbered after the target's)."""
        # Keys are stored transposed, [..., head_dim, max_len], so that k^T of the live prefix is a slice along the
        # last axis, which a bf16 matmul reads in place. Stored as [..., max_len, head_dim], the same prefix is a
        # batch-strided slice that torch copies before a bf16 matmul (SmolLM2 bf16 at B=32 on a 2-core AVX-512 EPYC:
        # copies take about half as long with keys transposed). Values stay as they are: stored transposed, the
        # probabilities-times-values matmul is slower.
        self.k = torch.zeros((num_layers, num_slots, num_kv_heads, head_dim, max_len), dtype=dtype, device=device)
        self.v = torch.zeros((num_layers, num_slots, num_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))
        """Each layer's (keys, values) as views made once: indexing the stores per layer and forward was two torch
        ops a layer, ~80 us of a ~3 ms speculative step at B=1 on the main job's tiny model (profiled)."""
        self.max_len = max_len
        self.free_slots = list(range(num_slots))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def allocate(self) -> int:
        # Lowest free slot first keeps running sequences packed, so most batches are one contiguous slice.
        self.free_slots.sort()
        return self.free_slots.pop(0)

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def copy_prefix(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy positions 0 .. length - 1 of slot sources[i] into slot targets[i], in every layer: sequences that
        share a prompt share its keys and values (`ModelRunner.prefill`). Past a shorter prompt's end the copy
        carries the source's padding, which lies beyond the target's length as it did beyond the source's."""
        src = torch.tensor(sources, device=self.k.device)
        dst = torch.tensor(targets, device=self.k.device)
        self.k[..., :length].index_copy_(1, dst, self.k[:, src, ..., :length])
        self.v[:, :, :, :length].index_copy_(1, dst, self.v[:, src, :, :length])

    def view(self, slots: list[int], starts: list[int], num_tokens: int) -> "BatchView":
        """A view for one forward that feeds `num_tokens` new tokens to each sequence, starting at `starts`."""
        return BatchView(self, slots, starts, num_tokens)


class BatchView:
    """Implements the model's `AttentionCache` protocol for one forward of a (possibly ragged) batch.

    Sequence b's new tokens sit at positions starts[b] .. starts[b] + T - 1 (right padding is allowed: padded
    queries see garbage but nobody reads their outputs, and their keys land beyond the sequence's length). Query t of sequence b may attend to key j iff
    j <= starts[b] + t.
    """

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], num_tokens: int):
        self.cache = cache
        device = cache.k.device
        B, T = len(slots), num_tokens
        # Only padding can run past the end (the engine sizes the cache for every real token plus the drafts), so
        # clamping parks padded writes on the last row, which no real token ever uses. Built in numpy and made a
        # tensor once: tensor arithmetic here (and reading the longest back) cost several small ops a forward, and
        # a Python list of lists through `torch.tensor` ~0.2 ms at 64 sequences x 4 tokens (`host`).
        last = cache.max_len - 1
        self.positions = spans(starts, T, last, device)
        longest = min(max(starts) + T - 1, last) + 1
        self.kv_len = min(longest + -longest % KV_BLOCK, cache.max_len)
        self.slots = long_tensor(slots, device)
        contiguous = slots == list(range(slots[0], slots[0] + B))
        self.rows = slice(slots[0], slots[0] + B) if contiguous else self.slots

    @cached_property
    def mask(self) -> Tensor:
        """[B, 1, T, kv_len], 0 where query t of sequence b may attend to key j (j <= starts[b] + t), else -inf."""
        key_pos = torch.arange(self.kv_len, device=self.positions.device)
        allowed = (key_pos[None, None, :] <= self.positions[:, :, None])[:, None]
        # Additive (0 / -inf) rather than boolean: attention adds it in place, one op per layer instead of
        # inverting a boolean mask and filling a copy of the scores (the same numbers: s + 0 = s).
        return torch.zeros(allowed.shape, dtype=self.cache.k.dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))

    @cached_property
    def flat_rows(self) -> Tensor:
        """Where each new value row goes in a layer's cache seen as [slots * kv_heads * max_len, head_dim], in the
        order of v.reshape(-1, head_dim) (sequence, head, token). With `key_elements`, one index_copy_ per tensor
        stores a step's keys or values, where indexing by (slot, position) pairs took a broadcasting index_put."""
        return (self.slot_head * self.cache.max_len + self.positions[:, None, :]).reshape(-1)

    @cached_property
    def key_elements(self) -> Tensor:
        """Where each new key element goes in the transposed keys seen flat, in the order of k.reshape(-1)
        (sequence, head, token, channel)."""
        max_len, head_dim = self.cache.max_len, self.cache.v.shape[-1]
        channel = torch.arange(head_dim, device=self.slots.device) * max_len
        start = self.slot_head * head_dim * max_len + self.positions[:, None, :]
        return (start[..., None] + channel).reshape(-1)

    @cached_property
    def slot_head(self) -> Tensor:
        """[B, kv_heads, 1]: the index of each sequence's heads in the cache's first two axes seen as one."""
        heads = self.cache.v.shape[2]
        return self.slots[:, None, None] * heads + torch.arange(heads, device=self.slots.device)[None, :, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # k, v: [B, kv_heads, T, head_dim]; store at (slot, :, position) then read back the live prefix, the keys
        # as a [B, kv_heads, kv_len, head_dim] view of the transposed store.
        kc, vc = self.layer_cache(layer)
        kc.view(-1).index_copy_(0, self.key_elements, k.reshape(-1))
        vc.view(-1, v.shape[-1]).index_copy_(0, self.flat_rows, v.reshape(-1, v.shape[-1]))
        keys = kc[self.rows, :, :, : self.kv_len].transpose(-1, -2)
        return keys, vc[self.rows, :, : self.kv_len], self.mask

    def layer_cache(self, layer: int) -> tuple[Tensor, Tensor]:
        """Model layer `layer`'s keys [slots, kv_heads, head_dim, max_len] and values [slots, kv_heads, max_len,
        head_dim] in this cache."""
        return self.cache.layers[layer - self.cache.first_layer]

    def attend(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: nn.Module | None,
               k_norm: nn.Module | None, heads: int) -> Tensor:
        """`update` and attention in two fused kernels (`megatron_spec.kernels`), for the engine's CPU forwards:
        `qkv` [B, T, (heads + 2 kv_heads) head_dim] is this step's projections, before any per-head norm (`q_norm`,
        `k_norm`: RMSNorm modules or None) and the rotary (`cos`, `sin`); returns the attention output
        [B, T, heads * head_dim]."""
        kc, vc = self.layer_cache(layer)
        q = self.store(layer, qkv, cos, sin, q_norm, k_norm, heads)
        return kernels.attention(q, kc, vc, self.slots, self.positions)

    def store(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: nn.Module | None,
              k_norm: nn.Module | None, heads: int) -> Tensor:
        """The first of `attend`'s kernels alone: store this step's keys and values; returns the queries, normed and
        rotated [B, T, heads, head_dim]."""
        kc, vc = self.layer_cache(layer)
        return kernels.rope_store(qkv, cos, sin, None if q_norm is None else q_norm.weight,
                                  None if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.eps,
                                  kc, vc, self.slots, self.positions, heads, kc.shape[1])
