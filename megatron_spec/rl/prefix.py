"""Prompt sharing in the trainer's forwards: each GRPO group's prompt goes through the trunk once per step.

The G rollouts of a group repeat one prompt, so a row-by-row forward computes that prompt G times (on the tiny task
about 30 % of a row's positions are prompt). Here the distinct prompts run once (the *prefix pass*), keeping every
layer's keys and values, and each row's completion runs on its own (the *suffix pass*), attending to its prompt's
keys and values and causally to its own. That is an exact rewrite of causal attention: a prompt position never sees
the completion, so its states are the same in every row of the group.

Gradients: the prefix pass's outputs (each layer's keys and values, the final hidden states) reach the suffix passes
as leaf tensors, so each micro-batch's backward stops at them and accumulates there; one backward through the prefix
pass after the last micro-batch (`SharedPrompts.backward`) sends the summed gradient into the weights. The result is
the unshared gradient up to fp32 summation order.

After the suffix pass the prompt's and the completion's states are laid back out as the batch's [b, T] rows
(`relayout`), so everything downstream (log-probs, losses, the drafter's inputs) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..models.masks import causal_mask
from ..microbatch import sequence_lengths


@dataclass(frozen=True)
class PromptGroups:
    """Which rows share a prompt."""

    prompt_len: list[int]
    """Per row: its prompt's length, the position of its first completion token (0 for a row without any)."""
    group: list[int]
    """Per row: the index of its distinct prompt."""
    first_row: list[int]
    """Per distinct prompt: the first row that holds it (where the prefix pass reads its tokens)."""

    @property
    def repeated(self) -> bool:
        """Some prompt is held by more than one row: only then does sharing save work."""
        return len(self.first_row) < len(self.group) and max(self.prompt_len) > 0


def prompt_groups(input_ids: Tensor, mask: Tensor) -> PromptGroups:
    """Rows of a right-padded batch (`mask` [B, T] True at completion tokens) grouped by identical prompt tokens.
    Detected from the content, not the row order, so any batch layout groups correctly."""
    starts = torch.where(mask.any(1), mask.int().argmax(1), 0).tolist()  # argmax: the first True
    ids = input_ids.tolist()
    index: dict[tuple[int, ...], int] = {}
    group, first_row = [], []
    for r, p in enumerate(starts):
        key = tuple(ids[r][:p])
        if key not in index:
            index[key] = len(first_row)
            first_row.append(r)
        group.append(index[key])
    return PromptGroups(starts, group, first_row)


def prefix_mask(prompt_len: Tensor, width: int, suffix: int) -> Tensor:
    """[b, 1, S, width + S]: suffix query s of row r sees prefix key j iff j < prompt_len[r] (the rest of the padded
    prefix block is padding of a shorter prompt) and suffix key u iff u <= s."""
    b, device = prompt_len.shape[0], prompt_len.device
    own_prompt = torch.arange(width, device=device) < prompt_len[:, None]
    causal = causal_mask(suffix, device)[0, 0]
    return torch.cat([own_prompt[:, None].expand(b, suffix, width), causal.expand(b, suffix, suffix)], -1)[:, None]


def layout_index(prompt_len: Tensor, width: int, suffix: int, length: int) -> Tensor:
    """[b, length]: where position t of row r lies in cat([prefix block (width), suffix block (S)], dim=1): t itself
    before the row's completion starts, width + t - prompt_len[r] after. Positions past the suffix block are padding
    (no loss, and causal attention keeps them out of every real position); they are clamped to its last column."""
    t = torch.arange(length, device=prompt_len.device)[None]
    p = prompt_len[:, None]
    return torch.where(t < p, t, width + t - p).clamp_max(width + suffix - 1)


def relayout(prefix: Tensor, suffix: Tensor, where: Tensor) -> Tensor:
    """Rows [b, length, H] from a prefix block [b, width, H] and a suffix block [b, S, H] (`layout_index`). A gather,
    so the backward scatters each position's gradient to the block it came from."""
    both = torch.cat([prefix, suffix], 1)
    return both.gather(1, where[..., None].expand(-1, -1, both.shape[-1]))


class RecordingCache:
    """The prefix pass's `AttentionCache`: causal attention over the prompts, keeping each layer's keys and values
    [n, KV, width, D] (after RoPE, as the suffix pass's attention reads them)."""

    def __init__(self, width: int, device: torch.device):
        self.mask = causal_mask(width, device)
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.keys[layer], self.values[layer] = k, v
        return k, v, self.mask


class PrefixCache:
    """The suffix pass's `AttentionCache`: each row's keys/values are its group's prompt's, then its own (`mask`
    from `prefix_mask`)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], group: Tensor, mask: Tensor):
        self.keys, self.values, self.group, self.mask = keys, values, group, mask

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k = torch.cat([self.keys[layer].index_select(0, self.group), k], 2)
        v = torch.cat([self.values[layer].index_select(0, self.group), v], 2)
        return k, v, self.mask


class SharedPrompts:
    """One batch's prefix pass (run on construction) and the suffix passes of its micro-batches (module docstring).

    Under `torch.no_grad` it is a plain forward; with gradients, call `backward()` once after every micro-batch's
    own backward."""

    def __init__(self, model: CausalLM, input_ids: Tensor, mask: Tensor, groups: PromptGroups,
                 capture: tuple[int, ...] = ()):
        self.model, self.input_ids, self.capture = model, input_ids, capture
        device = input_ids.device
        self.prompt_len = torch.tensor(groups.prompt_len, device=device)
        self.group = torch.tensor(groups.group, device=device)
        # Per row: the positions its suffix pass computes (its completion, up to its last generated token).
        self.suffix_lengths = [n - p for n, p in zip(sequence_lengths(mask), groups.prompt_len)]
        self.width = max(groups.prompt_len)
        prompts = torch.zeros(len(groups.first_row), self.width, dtype=input_ids.dtype, device=device)
        for i, r in enumerate(groups.first_row):
            prompts[i, : groups.prompt_len[r]] = input_ids[r, : groups.prompt_len[r]]
        cache = RecordingCache(self.width, device)
        out = model.trunk(prompts, cache=cache, capture=capture)
        layers = sorted(cache.keys)
        self.outputs = [cache.keys[i] for i in layers] + [cache.values[i] for i in layers] + [out.hidden]
        # Leaves cut from the prefix graph: the micro-batches' backward passes accumulate into their .grad.
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in self.outputs]
        n = len(layers)
        self.keys, self.values, self.hidden = self.leaves[:n], self.leaves[n : 2 * n], self.leaves[-1]
        self.layers = {i: h.detach() for i, h in out.layers.items()}  # only the drafter reads them, detached

    def trunk(self, rows: list[int], length: int) -> TrunkOutput:
        """The trunk's output for `rows` of the batch cropped to `length` positions, [b, length, H] as an unshared
        forward gives it (padding positions aside), computing only the rows' completions."""
        idx = torch.tensor(rows, device=self.input_ids.device)
        p, group = self.prompt_len[idx], self.group[idx]
        n = torch.tensor([self.suffix_lengths[r] for r in rows], device=idx.device)
        S = int(n.max())
        s = torch.arange(S, device=idx.device)[None]
        positions = p[:, None] + s
        rows_ids = self.input_ids.index_select(0, idx)
        ids = torch.where(s < n[:, None], rows_ids.gather(1, positions.clamp_max(rows_ids.shape[1] - 1)), 0)
        cache = PrefixCache(self.keys, self.values, group, prefix_mask(p, self.width, S))
        out = self.model.trunk(ids, positions, cache, self.capture)
        where = layout_index(p, self.width, S, length)
        hidden = relayout(self.hidden.index_select(0, group), out.hidden, where)
        layers = {i: relayout(self.layers[i].index_select(0, group), h, where) for i, h in out.layers.items()}
        return TrunkOutput(hidden, layers)

    def backward(self) -> None:
        """The prompts' share of the gradient, accumulated over every micro-batch, through the prefix pass (once).
        An output no micro-batch reached (grad None) has nothing to send."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self.outputs, self.leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
