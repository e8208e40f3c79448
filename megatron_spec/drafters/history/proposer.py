"""History lookup: drafting from the other rollouts of the same prompt (its GRPO group, in flight) and that
prompt's rollouts from earlier RL steps, then from the sequence's own tokens (prompt lookup's `SuffixIndex`)."""

from __future__ import annotations

from ..ngram.proposer import NgramProposer, SuffixIndex
from ..proposer import Drafts


class HistoryProposer(NgramProposer):
    """Group and history lookup first (other rollouts of the same prompt, now and from earlier steps), the
    sequence's own tokens second. Finished rollouts are kept per prompt across `generate` calls."""

    def __init__(self, n_min: int, n_max: int, docs_per_prompt: int):
        super().__init__(n_min, n_max)
        self.docs_per_prompt = docs_per_prompt
        self.finished: dict[tuple[int, ...], list[list[int]]] = {}

    def start(self, seqs, params, max_len, num_slots) -> None:
        super().start(seqs, params, max_len, num_slots)
        self.groups: dict[tuple[int, ...], SuffixIndex] = {}
        self.group_of = {}
        self.outputs_indexed = {s.index: 0 for s in seqs}
        for s in seqs:
            key = tuple(s.prompt)
            if key not in self.groups:
                index = SuffixIndex(self.n_min, self.n_max)
                for doc in self.finished.get(key, []):
                    index.add(doc, 0, len(doc) + 1)
                self.groups[key] = index
            self.group_of[s.index] = self.groups[key]

    def propose(self, seqs, k: int) -> Drafts:
        # Siblings' new tokens go into their group index first, so each sequence sees the whole group's latest text.
        for s in seqs:
            self.group_of[s.index].add(s.output, self.outputs_indexed[s.index], len(s.output))
            self.outputs_indexed[s.index] = len(s.output)
        drafts = []
        for s in seqs:
            budget = min(k, s.remaining - 1)
            group = self.group_of[s.index].continuation(s.tokens, budget)
            own = self.own(s, budget)
            drafts.append(group if len(group) >= len(own) else own)
        return Drafts(drafts)

    def finish(self, seq) -> None:
        docs = self.finished.setdefault(tuple(seq.prompt), [])
        docs.append(list(seq.output))
        del docs[: -self.docs_per_prompt]
