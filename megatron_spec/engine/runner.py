"""Runs the target model over a batch of sequences through the KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..models.host import long_tensor
from ..models.kv_cache import KVCache
from ..models.packed import linears
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, capture: tuple[int, ...] = ()):
        self.model = model
        self.cache = cache
        self.capture = capture
        """Target layers whose hidden states a drafter reads (EAGLE-3); empty for most drafters."""

    def forward(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> TrunkOutput:
        """Feed each sequence its `new_tokens` (ragged, right-padded) after its cached ones; advance its cache."""
        T = max(len(t) for t in new_tokens)
        ids = long_tensor([t + [0] * (T - len(t)) for t in new_tokens], self.model.device)
        view = self.cache.view([s.slot for s in seqs], [s.num_cached for s in seqs], T)
        out = self.model.trunk(ids, view.positions, view, capture=self.capture)
        for seq, toks in zip(seqs, new_tokens):
            seq.num_cached += len(toks)
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        return linears(hidden, self.model.lm_head)[0]

    def prefill(self, seqs: list[Sequence]) -> tuple[Tensor, TrunkOutput]:
        """Next-token logits [B, V] after each prompt (the head runs on the last prompt position only).

        Sequences with the same prompt share one forward: GRPO samples a group of rollouts per prompt, and running
        each copy cost the main job's 8 prompts x 8 samples 38 ms a rollout of ~280 ms against 7 ms for the 8 prompts
        alone (2-core AVX2 EPYC). The first of each prompt's sequences runs; the others get its keys and values
        copied into their slots and its hidden states, so each samples its own tokens from the same distribution."""
        firsts: dict[tuple[int, ...], int] = {}
        rep = [firsts.setdefault(tuple(s.prompt), b) for b, s in enumerate(seqs)]
        leaders = [seqs[b] for b in firsts.values()]
        out = self.forward(leaders, [s.prompt for s in leaders])
        if len(leaders) < len(seqs):
            copies = [b for b in range(len(seqs)) if rep[b] != b]
            self.cache.copy_prefix([seqs[rep[b]].slot for b in copies], [seqs[b].slot for b in copies],
                                   max(len(seqs[b].prompt) for b in copies))
            for b in copies:
                seqs[b].num_cached = len(seqs[b].prompt)
            row = {b: i for i, b in enumerate(firsts.values())}
            rows = torch.tensor([row[r] for r in rep], device=out.hidden.device)
            out = TrunkOutput(out.hidden[rows], {layer: h[rows] for layer, h in out.layers.items()})
        last = torch.tensor([len(s.prompt) - 1 for s in seqs], device=out.hidden.device)
        rows = torch.arange(len(seqs), device=out.hidden.device)
        return self.logits(out.hidden[rows, last]), out

    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[Tensor, TrunkOutput]:
        """Logits [B, 1 + k, V] after feeding each sequence its last token and its drafts (plain decode: none)."""
        out = self.forward(seqs, [[s.last_token] + d for s, d in zip(seqs, drafts)])
        return self.logits(out.hidden), out
