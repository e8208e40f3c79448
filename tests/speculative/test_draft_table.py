"""The tensor forms a hidden-state proposer hands the engine: the catch-up's token table (`ahead_tokens`) and
`Drafts` given as a padded table, each against the per-sequence list code it replaces, on random inputs."""

import random

import torch

from megatron_spec.engine.sequence import Sequence
from megatron_spec.drafters.proposer import Drafts
from megatron_spec.drafters.hidden import ahead_tokens


def reference_ahead(seqs, starts, width):
    """The list form: sequence b's tokens from starts[b] + 1 to its end, cut or zero-padded to `width`."""
    rows = []
    for s, c in zip(seqs, starts):
        tail = s.tokens[c + 1 : c + 1 + width]
        rows.append(tail + [0] * (width - len(tail)))
    return rows


def test_ahead_tokens_equal_list_slicing():
    """Random prompts and outputs (empty outputs included), frontiers anywhere from the prompt's start to the
    sequence's second-to-last token, and one or two extra columns (a two-depth head's)."""
    rng = random.Random(0)
    for trial in range(200):
        seqs, starts = [], []
        for i in range(rng.randint(1, 9)):
            prompt = [rng.randint(1, 63) for _ in range(rng.randint(1, 12))]
            s = Sequence(i, prompt, 100, torch.Generator())
            s.output = [rng.randint(1, 63) for _ in range(rng.randint(0, 12))]
            seqs.append(s)
            starts.append(rng.randint(0, s.length - 2) if s.length >= 2 else 0)
        counts = [s.length - 1 - c for s, c in zip(seqs, starts)]
        width = max(counts) + rng.randint(0, 2)
        got = ahead_tokens(seqs, starts, counts, width, "cpu")
        assert got.dtype == torch.int64
        assert got.tolist() == reference_ahead(seqs, starts, width), trial


def test_drafts_table_and_lists_agree():
    """Ragged lists pad with 0 into the table the engine feeds; a table with lengths reads back as those lists;
    no drafts at all give a [B, 0] table."""
    rng = random.Random(1)
    for _ in range(100):
        lists = [[rng.randint(0, 63) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 6))]
        k = max(len(d) for d in lists)
        table = Drafts(lists).padded("cpu")
        assert table.shape == (len(lists), k)
        assert table.tolist() == [d + [0] * (k - len(d)) for d in lists]
        assert Drafts(None, table=table, lengths=[len(d) for d in lists]).tokens == lists
    assert Drafts.none(3).padded("cpu").shape == (3, 0)
    assert Drafts.none(3).tokens == [[], [], []] and Drafts.none(3).lengths == [0, 0, 0]
