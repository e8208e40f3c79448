"""`draft_model`: a smaller model of the same vocabulary drafts autoregressively with its own KV cache."""

from __future__ import annotations

import torch

from ...models.host import long_tensor
from ...models.kv_cache import KVCache
from ...models.decoder import CausalLM
from ..proposer import Drafts, Proposer, choose_drafts


class DraftModelProposer(Proposer):
    def __init__(self, model: CausalLM, sample: bool):
        self.model = model.eval()
        self.sample = sample
        self.cache: KVCache | None = None

    def start(self, seqs, params, max_len, num_slots) -> None:
        cfg = self.model.config
        if self.cache is None or self.cache.num_slots < num_slots or self.cache.max_len < max_len:
            self.cache = KVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                 self.model.dtype, self.model.device)
        self.params = params
        self.seen: dict[int, list[int]] = {s.index: [] for s in seqs}
        """Tokens whose keys/values are in the draft cache, per sequence (drafts included until verified)."""

    def propose(self, seqs, k: int) -> Drafts:
        # Keep the cached prefix that still agrees with the sequence (rejected drafts fall away), feed the rest.
        feeds, starts = [], []
        for s in seqs:
            tokens, seen = s.tokens, self.seen[s.index]
            keep = 0
            limit = min(len(seen), len(tokens) - 1)
            while keep < limit and seen[keep] == tokens[keep]:
                keep += 1
            del seen[keep:]
            feeds.append(tokens[keep:])
            starts.append(keep)
        budget = [max(0, min(k, s.remaining - 1)) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs = []
        for step in range(max(budget)):
            logits = self.forward(seqs, starts, feeds)
            tokens, q = choose_drafts(logits, self.params, seqs, self.sample)
            probs.append(q)
            for b, s in enumerate(seqs):
                self.seen[s.index].extend(feeds[b])
                starts[b] += len(feeds[b])
                feeds[b] = [int(tokens[b])]
                if step < budget[b]:
                    drafts[b].append(int(tokens[b]))
        stacked = torch.stack(probs, 1) if probs and probs[0] is not None else None
        return Drafts(drafts, stacked)

    def forward(self, seqs, starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """Draft logits [B, V] after feeding each sequence its pending tokens (ragged, right-padded)."""
        T = max(len(f) for f in feeds)
        ids = long_tensor([f + [0] * (T - len(f)) for f in feeds], self.model.device)
        view = self.cache.view([s.slot for s in seqs], starts, T)
        hidden = self.model.trunk(ids, view.positions, view).hidden
        last = long_tensor([len(f) - 1 for f in feeds], ids.device)
        return self.model.lm_head(hidden[torch.arange(len(seqs), device=ids.device), last])
