"""Runs the target model over a batch of sequences through the KV cache."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..models.host import long_tensor
from ..models.kv_cache import KVCache
from ..models.packed import linears
from ..models.routing import choices
from ..drafters.proposer import Drafts
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, capture: tuple[int, ...] = (), routing: bool = False):
        self.model = model
        self.cache = cache
        self.capture = capture
        """Target layers whose hidden states a drafter reads (EAGLE-3); empty for most drafters."""
        self.routing = routing
        """Read each forward's MoE routing into its output (`TrunkOutput.routing`), for routing replay."""

    def forward(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> TrunkOutput:
        """Feed each sequence its `new_tokens` (ragged, right-padded) after its cached ones; advance its cache."""
        T = max(len(t) for t in new_tokens)
        ids = long_tensor([t + [0] * (T - len(t)) for t in new_tokens], self.model.device)
        return self.forward_ids(seqs, ids, [len(t) for t in new_tokens])

    def forward_ids(self, seqs: list[Sequence], ids: Tensor, counts: list[int]) -> TrunkOutput:
        """Feed sequence b the first counts[b] of `ids` [B, T] (the rest is padding) after its cached tokens."""
        view = self.cache.view([s.slot for s in seqs], [s.num_cached for s in seqs], ids.shape[1])
        out = self.model.trunk(ids, view.positions, view, capture=self.capture)
        if self.routing:
            out.routing = choices(self.model, *ids.shape)
        for seq, n in zip(seqs, counts):
            seq.num_cached += n
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        return linears(hidden, self.model.lm_head)[0]

    def prefill(self, seqs: list[Sequence]) -> tuple[Tensor, TrunkOutput]:
        """Next-token logits [B, V] after each prompt (the head runs on the last prompt position only).

        Sequences with the same prompt share one forward: GRPO samples a group of rollouts per prompt, and running
        each copy cost the main job's 8 prompts x 8 samples 38 ms a rollout of ~280 ms against 7 ms for the 8 prompts
        alone (2-core AVX2 EPYC). The first of each prompt's sequences runs; the others get its keys and values
        copied into their slots and its hidden states, so each samples its own tokens from the same distribution."""
        row: dict[tuple[int, ...], int] = {}  # a prompt -> its leader's row in the forward
        leaders: list[Sequence] = []
        source = []  # each sequence's leader's row
        for s in seqs:
            source.append(row.setdefault(tuple(s.prompt), len(leaders)))
            if source[-1] == len(leaders):
                leaders.append(s)
        out = self.forward(leaders, [s.prompt for s in leaders])
        if len(leaders) < len(seqs):
            copies = [(leaders[r], s) for r, s in zip(source, seqs) if leaders[r] is not s]
            self.cache.copy_prefix([lead.slot for lead, _ in copies], [s.slot for _, s in copies],
                                   max(len(s.prompt) for _, s in copies))
            for _, s in copies:
                s.num_cached = len(s.prompt)
            index = long_tensor(source, out.hidden.device)
            out = TrunkOutput(out.hidden[index], {layer: h[index] for layer, h in out.layers.items()},
                              None if out.routing is None else out.routing[index])
        last = torch.tensor([len(s.prompt) - 1 for s in seqs], device=out.hidden.device)
        rows = torch.arange(len(seqs), device=out.hidden.device)
        return self.logits(out.hidden[rows, last]), out

    def verify(self, seqs: list[Sequence], drafts: Drafts) -> tuple[Tensor, TrunkOutput]:
        """Logits [B, 1 + k, V] after feeding each sequence its last token and its drafts (plain decode: none)."""
        device = self.model.device
        ids = long_tensor(np.fromiter((s.last_token for s in seqs), np.int64, len(seqs))[:, None], device)
        if max(drafts.lengths):
            ids = torch.cat([ids, drafts.padded(device)], 1)
        out = self.forward_ids(seqs, ids, [1 + n for n in drafts.lengths])
        return self.logits(out.hidden), out
