"""Prompt lookup: drafting the continuation of the sequence's own suffix where it occurred before.

`SuffixIndex` (shared with the history drafter, `drafters/history/`) is a dict from each n-gram (n in [n_min,
n_max]) to its latest few occurrences, updated as tokens arrive (O(n_max) per token), so a lookup is n_max dict
probes instead of a scan.
"""

from __future__ import annotations

from ..proposer import Drafts, Proposer

RECENT = 8
"""Occurrences kept per n-gram. In a pattern that repeats every P tokens the latest occurrence of the suffix is P
tokens from the end, so its continuation is cut to P < k tokens; the occurrence ceil(k / P) periods back has all k.
Keeping 8 serves every k <= 8 in full at a bounded memory cost (on the tiny model's repeating text it raises the
acceptance length; where the text does not repeat it changes nothing: `research/ngram_index_acceptance.py`)."""


class SuffixIndex:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.where: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}
        """n-gram -> its latest occurrences, oldest first, as (document, position right after the occurrence)."""

    def add(self, doc: list[int], start: int, end: int) -> None:
        """Index the n-grams of `doc` that end at positions start..end-1 (exclusive end)."""
        for p in range(max(start, 1), end):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                seen = self.where.setdefault(tuple(doc[p - n : p]), [])
                seen.append((doc, p))
                if len(seen) > RECENT:
                    del seen[0]

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest indexed n-gram equal to a suffix of `tokens`: those after its
        latest occurrence, extended where an earlier occurrence went on the same way for longer (in a repeating
        pattern the latest occurrence is cut short by the end of the text; an earlier one that continued
        differently is a worse guess than the latest text, so it never replaces it)."""
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            seen = self.where.get(tuple(tokens[-n:]))
            if seen:
                doc, p = seen[-1]
                best = doc[p : p + k]
                for doc, p in reversed(seen[:-1]):
                    if len(best) == k:
                        break
                    follow = doc[p : p + k]
                    if len(follow) > len(best) and follow[: len(best)] == best:
                        best = follow
                return best
        return []


class NgramProposer(Proposer):
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's own suffix."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def start(self, seqs, params, max_len, num_slots) -> None:
        self.index = {s.index: SuffixIndex(self.n_min, self.n_max) for s in seqs}
        self.indexed = {s.index: 0 for s in seqs}

    def own(self, seq, k: int) -> list[int]:
        tokens = seq.tokens
        # Index up to the previous position only: the suffix itself must not match its own, continuation-less end.
        self.index[seq.index].add(tokens, self.indexed[seq.index], len(tokens))
        self.indexed[seq.index] = len(tokens)
        return self.index[seq.index].continuation(tokens, k)

    def propose(self, seqs, k: int) -> Drafts:
        return Drafts([self.own(s, min(k, s.remaining - 1)) for s in seqs])
