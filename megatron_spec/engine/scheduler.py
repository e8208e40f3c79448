"""Continuous batching: waiting sequences join as slots free up, finished ones leave at once.

A step is either a prefill (new sequences' prompts) or a decode (every running sequence), never a mix, so the
padding of a step stays small: prompts pad to the longest new prompt, decodes feed the same count per sequence.
"""

from __future__ import annotations

from collections import deque

from ..models.kv_cache import KVCache
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences for this step, is_prefill). Prefill whenever a waiting sequence fits."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            longest = max([len(s.prompt) for s in batch] + [len(seq.prompt)])
            if batch and longest * (len(batch) + 1) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.slot, seq.status = self.cache.allocate(), Status.RUNNING
            batch.append(seq)
            tokens = longest * len(batch)
        if batch:
            self.running.extend(batch)
            return batch, True
        # Slot order keeps the KV rows of a decode batch one contiguous slice whenever no gaps are open.
        self.running.sort(key=lambda s: s.slot)
        return list(self.running), False

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.cache.release(seq.slot)
