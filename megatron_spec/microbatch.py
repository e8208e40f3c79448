"""Length-bucketed micro-batches for the trainer's forwards.

A GRPO batch is right-padded to its longest rollout, and rollout lengths are long-tailed: on the tiny workload the
longest of 64 rollouts is often 3-4x the mean, so most of a padded forward is spent on padding (and attention is
quadratic in it). Sorting the sequences by length and cutting them into micro-batches, each padded only to its own
longest, skips that work. The losses stay exact because every micro-batch is aggregated with the whole batch's
denominators (`grpo.LossNorm`) and the gradients are accumulated into one optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where tensors are used: the simulator imports `micro_batches` and stays torch-free
    from torch import Tensor


def sequence_lengths(mask: Tensor) -> list[int]:
    """Used length of each row of a right-padded batch: up to its last generated token (`mask` [B, T]), at least 2
    so every row keeps one next-token prediction. Positions past it never influence the ones before (causal model)
    and carry no loss, so cropping them changes nothing."""
    import torch

    end = mask.shape[1] - mask.flip(1).int().argmax(1)  # one past the last True (argmax: its first occurrence)
    return torch.where(mask.any(1), end, 0).clamp_min(2).tolist()


def spread_rows(mask: Tensor, max_tokens: int) -> list[int]:
    """Rows of a batch (generated-token mask [B, T]) whose used lengths (`sequence_lengths`: prompt and completion,
    what a forward over them holds) total at most `max_tokens`, taken in the bit-reversed order of their index (0,
    B/2, B/4, 3B/4, ...) so that they spread over the batch's prompts rather than fill the first groups; at least
    one row; every row when `max_tokens` is 0. Sorted."""
    B = mask.shape[0]
    if max_tokens <= 0:
        return list(range(B))
    bits = max(B - 1, 1).bit_length()
    order = sorted(range(B), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))
    tokens = sequence_lengths(mask)
    taken, total = [], 0
    for i in order:
        if taken and total + tokens[i] > max_tokens:
            continue
        taken.append(i)
        total += tokens[i]
    return sorted(taken)


def micro_batches(lengths: list[float], token_budget: int) -> list[list[int]]:
    """Row indices of each micro-batch. Rows sorted longest first (ties by index, so the cut is deterministic) are
    taken greedily while the micro-batch's padded size, rows x its longest length, stays within `token_budget`; a
    row longer than the budget goes alone. `token_budget` 0: one micro-batch of every row in the original order."""
    if token_budget <= 0:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        # Sorted longest first, so a micro-batch's first row sets its padded length.
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= token_budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out
