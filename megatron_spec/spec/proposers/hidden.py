"""Drafters that read the target's hidden states: Megatron-layout MTP heads and the EAGLE-3 head.

Depth i of a head at position t reads a hidden state for t and the token at t+i+1, and predicts the token at
t+i+2 (MTP depth i; EAGLE-3 has one depth). Each round:

1. catch up: run every depth over the positions whose drafter KV is not yet final, from the frontier c to the
   last position with a target hidden state (L-2 for a sequence of L tokens); depth i reads depth i-1's states at
   the same positions and the tokens one further ahead, the last of which are this round's drafts;
2. the last row of depth i gives draft i+1;
3. past the last depth, chain: the last depth reads its own previous state at the next position.

Depth i's keys at position t are final once every token it read there is verified (t <= L-2-i), so the frontier
moves to L-D: what lies beyond is recomputed next round, never trusted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...engine.kv_cache import KVCache
from ...models.decoder import CausalLM, TrunkOutput
from ...models.eagle3 import Eagle3Head
from ...models.mtp import MTP
from .base import Drafts, Proposer, choose_drafts


class HiddenStateProposer(Proposer):
    def __init__(self, target: CausalLM, head: MTP | Eagle3Head, sample: bool):
        self.target, self.head, self.sample = target, head.eval(), sample
        self.is_mtp = isinstance(head, MTP)
        self.depths = len(head.layers) if self.is_mtp else 1
        self.capture_layers = () if self.is_mtp else tuple(head.capture_layers)
        self.cache: KVCache | None = None

    def start(self, seqs, params, max_len, num_slots) -> None:
        cfg = self.target.config
        if self.cache is None or self.cache.num_slots < num_slots or self.cache.max_len < max_len:
            self.cache = KVCache(self.head.num_cache_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                 self.target.dtype, self.target.device, first_layer=cfg.num_hidden_layers)
            # Target features by (slot, position): one batched write per target forward, one gather per round.
            self.features = torch.zeros(num_slots, max_len, cfg.hidden_size, dtype=self.target.dtype,
                                        device=self.target.device)
        self.params = params
        self.frontier = {s.index: 0 for s in seqs}

    def observe(self, seqs, out: TrunkOutput, starts, valid) -> None:
        feats = out.hidden if self.is_mtp else self.head.fuse(out.layers)
        B, T = feats.shape[:2]
        device = feats.device
        keep = torch.arange(T, device=device)[None] < torch.tensor(valid, device=device)[:, None]
        slots = torch.tensor([s.slot for s in seqs], device=device)[:, None].expand(B, T)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
        self.features[slots[keep], positions[keep]] = feats[keep]

    def step(self, depth: int, hidden: Tensor, ids: Tensor, positions: Tensor, view) -> tuple[Tensor, Tensor]:
        if self.is_mtp:
            return self.head(hidden, ids, positions, self.target.embed, self.target.lm_head, view, layer=depth)
        return self.head(hidden, ids, positions, self.target.embed, view)

    def propose(self, seqs, k: int) -> Drafts:
        B, device = len(seqs), self.target.device
        budget = [max(0, min(k, s.remaining - 1)) for s in seqs]
        ext = [s.tokens for s in seqs]  # grows by each round's drafts
        starts = [self.frontier[s.index] for s in seqs]
        counts = [len(e) - 1 - c for e, c in zip(ext, starts)]  # positions c .. L-2
        T = max(counts)
        slots = [s.slot for s in seqs]
        rows = (torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)).clamp_(
            max=self.features.shape[1] - 1)  # rows past a sequence's count are padding
        hidden = self.features[torch.tensor(slots, device=device)[:, None], rows]
        last = torch.tensor([n - 1 for n in counts], device=device)
        rows_b = torch.arange(B, device=device)
        drafts, probs = [[] for _ in seqs], []
        for j in range(max(budget)):
            depth = min(j, self.depths - 1)
            if j < self.depths:  # catch-up rows c..L-2 for this depth, tokens j+1 ahead
                ids = torch.tensor([e[c + j + 1 : c + j + 1 + T] + [0] * (T - len(e[c + j + 1 : c + j + 1 + T]))
                                    for e, c in zip(ext, starts)], device=device)
                view = self.cache.view(slots, starts, T)
                hidden, logits = self.step(depth, hidden, ids, view.positions, view)
                state, logits = hidden[rows_b, last], logits[rows_b, last]
            else:  # chain the last depth one position further, on its own previous state
                pos = [c + n + (j - self.depths) for c, n in zip(starts, counts)]
                ids = torch.tensor([[e[p + depth + 1]] for e, p in zip(ext, pos)], device=device)
                view = self.cache.view(slots, pos, 1)
                state, logits = self.step(depth, state[:, None], ids, view.positions, view)
                state, logits = state[:, 0], logits[:, 0]
            tokens, q = choose_drafts(logits, self.params, seqs, self.sample)
            probs.append(q)
            for b, t in enumerate(tokens.tolist()):
                ext[b].append(t)
                if j < budget[b]:
                    drafts[b].append(t)
        for s in seqs:  # depth i is final up to L-2-i, so everything from L-D on is redone next round
            self.frontier[s.index] = max(s.length - self.depths, 0)
        stacked = torch.stack(probs, 1) if probs and probs[0] is not None else None
        return Drafts(drafts, stacked)
