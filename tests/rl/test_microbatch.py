"""Length buckets: which rows go together, and how much of each row is kept."""

import torch

from megatron_spec.microbatch import micro_batches, sequence_lengths


def test_rows_are_sorted_longest_first_and_cut_at_the_padded_budget():
    """Lengths [4, 6, 2, 2, 9, 1], budget 12: 9 alone (2 x 9 > 12), then 6 + 4 (2 x 6 = 12), then 2, 2, 1 (3 x 2)."""
    assert micro_batches([4, 6, 2, 2, 9, 1], 12) == [[4], [1, 0], [2, 3, 5]]


def test_a_row_longer_than_the_budget_goes_alone_and_ties_keep_index_order():
    assert micro_batches([5, 50, 5, 5], 10) == [[1], [0, 2], [3]]


def test_every_row_exactly_once_within_budget():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(200, generator=g) ** 3 * 96).int().add(2).tolist()
    groups = micro_batches(lengths, 512)
    assert sorted(i for rows in groups for i in rows) == list(range(200))
    assert all(len(rows) == 1 or len(rows) * max(lengths[i] for i in rows) <= 512 for rows in groups)


def test_budget_zero_is_one_batch_in_order():
    assert micro_batches([3, 9, 4], 0) == [[0, 1, 2]]


def test_lengths_end_at_the_last_generated_token_and_keep_one_prediction():
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, 2:4] = True  # ends at 4
    mask[1, 3:8] = True  # runs to the end
    mask[3, 1] = True  # one token: still 2 positions
    assert sequence_lengths(mask) == [4, 8, 2, 2]  # row 2 has no completion: 2 as well
