"""The lookup drafters' index: which continuation a suffix match drafts."""

from megatron_spec.drafters.ngram.proposer import RECENT, SuffixIndex


def indexed(tokens: list[int], n_min: int = 2, n_max: int = 4) -> SuffixIndex:
    index = SuffixIndex(n_min, n_max)
    index.add(tokens, 0, len(tokens))  # as the proposer does: every n-gram that ends before the last position
    return index


def test_a_short_period_still_drafts_k_tokens():
    """Period 2 (`7 8 7 8 ...`): the latest earlier occurrence of the suffix `7 8` is 2 tokens from the end, so
    drafting from it gives 1-2 tokens; an occurrence k/2 periods back is followed by all k, and those are drafted."""
    tokens = [5, 6] + [7, 8] * 6
    index = indexed(tokens)
    assert index.continuation(tokens, 3) == [7, 8, 7]
    assert index.continuation(tokens, 5) == [7, 8, 7, 8, 7]


def test_the_latest_full_occurrence_wins():
    """Two earlier occurrences of `1 2`, each followed by k tokens: the latest one's continuation is drafted (the
    most recent text is the best guess of what comes next)."""
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 6, 7, 8, 9, 1, 2]
    assert indexed(tokens).continuation(tokens, 3) == [6, 7, 8]


def test_an_earlier_occurrence_only_extends_the_latest():
    tokens = [1, 2, 3, 9, 9, 1, 2, 4, 1, 2]
    # occurrences of `1 2` end at 2 (followed by 3 9 9 1 2 4 1 2) and 7 (followed by 4 1 2): k=3 takes the latest
    assert indexed(tokens).continuation(tokens, 3) == [4, 1, 2]
    # k=5: the earlier occurrence has 5 tokens after it but went on differently; the latest text is the better guess
    assert indexed(tokens).continuation(tokens, 5) == [4, 1, 2]
    # the longest suffix match (n=3: `4 1 2`) comes before shorter ones even if it is followed by fewer tokens
    tokens = [4, 1, 2, 8, 1, 2, 5, 5, 5, 5, 4, 1, 2]
    assert indexed(tokens).continuation(tokens, 4) == [8, 1, 2, 5]
    # a pattern that repeats with a longer period: the earlier occurrence extends the latest, which the end cuts
    tokens = [7] + [1, 2, 3] * 3 + [1, 2]
    assert indexed(tokens).continuation(tokens, 3) == [3, 1, 2]
    assert indexed(tokens).continuation(tokens, 5) == [3, 1, 2, 3, 1]


def test_memory_per_ngram_is_bounded():
    tokens = [3, 4] * 100
    index = indexed(tokens)
    assert max(len(v) for v in index.where.values()) == RECENT
