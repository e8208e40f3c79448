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

An EAGLE-3 head with a draft vocabulary scores only its `d2t` ids; `choose_mapped` turns its choice into a target
id (what is drafted, verified and fed to the head's next step, whose embedding is the target's) and its sampled q
into a distribution over the full target vocabulary, zero off the map, which is what lossless verification needs.

`FeatureRecorder` drafts nothing: it keeps the states these drafters read, for training them offline
(`train-drafter` records them while the target generates its rollouts instead of running the target again).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..models.host import long_tensor, spans
from ..models.kv_cache import KVCache
from ..models.decoder import CausalLM, TrunkOutput
from .eagle3.model import Eagle3Head
from .mtp.model import MTP
from .proposer import Drafts, Proposer, choose_drafts


def choose_mapped(logits: Tensor, d2t: Tensor | None, vocab_size: int, params, seqs, sample: bool
                  ) -> tuple[Tensor, Tensor | None]:
    """`choose_drafts` over draft-vocabulary logits [B, N], returned in target ids: tokens d2t[choice] [B], and a
    sampled q scattered to [B, vocab_size]. q(x) is then the drafter's true probability of proposing target id x
    (zero for ids it cannot propose), so min(1, p/q) and the residual max(p - q, 0) stay exact. Without a map
    (d2t None) this is `choose_drafts`."""
    tokens, q = choose_drafts(logits, params, seqs, sample)
    if d2t is None:
        return tokens, q
    if q is not None:
        q = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, d2t, q)
    return d2t[tokens], q


def write_rows(buffer: Tensor, writes: list[tuple[list[int], list[int], list[int], tuple[Tensor, ...]]]) -> None:
    """Apply `writes` in order, each (rows, starts, valid, parts): buffer[rows[b], starts[b] + t] = cat(parts, -1)[b, t]
    for the first valid[b] positions t of each sequence b (padding positions past valid[b] are dropped). Where two
    writes land on one place (a slot reused by a new sequence) the later one stands.

    One `index_copy_` into the flattened buffer, however many writes: on a ~1 ms decode step a tensor-built
    advanced-index write cost several times as much (100 us against 17 us at batch 64). The places are worked out
    in numpy, a write at a time: the ~100 decode steps a rollout of the main job holds before its first draft took
    ~6 ms as one Python list of places (B x steps integers), about half of that first drafting step."""
    length = buffer.shape[1]
    slots, starts = [], []
    for rows, begin, _, _ in writes:
        slots += rows
        starts += begin
    first = np.asarray(slots, dtype=np.int64) * length + np.asarray(starts, dtype=np.int64)  # each sequence's first
    dest: list[np.ndarray] = []
    columns: list[list[Tensor]] = [[] for _ in writes[0][3]]
    at = 0
    for _, _, valid, parts in writes:
        B, T = parts[0].shape[:2]
        places, keep = first[at : at + B, None] + np.arange(T), None
        at += B
        if sum(valid) < B * T:
            keep = np.arange(T) < np.asarray(valid)[:, None]
            places, keep = places[keep], torch.from_numpy(np.flatnonzero(keep)).to(buffer.device)
        dest.append(places.reshape(-1))
        for column, part in zip(columns, parts):
            flat = part.reshape(B * T, -1)
            column.append(flat if keep is None else flat[keep])
    src = joined([joined(column) for column in columns], -1)
    places = np.concatenate(dest)
    # index_copy_ leaves duplicates unordered: keep each place's last write only (np.unique's first of the reversed)
    if np.bincount(places).max() > 1:
        last = np.sort(places.size - 1 - np.unique(places[::-1], return_index=True)[1])
        places, src = places[last], src[torch.from_numpy(last).to(buffer.device)]
    buffer.view(-1, buffer.shape[-1]).index_copy_(0, torch.from_numpy(places).to(buffer.device), src)


def joined(tensors: list[Tensor], dim: int = 0) -> Tensor:
    """torch.cat without the copy when there is only one."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


STORE_ONLY_FROM = 8
"""A catch-up over at least this many positions runs the last depth only as far as its keys and values (`store`:
its keys at a position depend on that position's inputs alone) and the whole layer on each sequence's last row,
the one the chain reads on; a shorter one, as in a round right after a drafting one (1 to k + 1 positions), keeps
one call. On the main job's MTP head the other rows' attention and MLP were most of a catch-up. A greedy MTP head's
last depth takes `MTP.draft` instead where the kernels apply, which stores the other rows at any length."""

MAX_PENDING_BYTES = 64 << 20  # target states a hidden-state proposer holds before writing them (`observe`)


class HiddenStateProposer(Proposer):
    def __init__(self, target: CausalLM, head: MTP | Eagle3Head, sample: bool):
        self.target, self.head, self.sample = target, head.eval(), sample
        self.is_mtp = isinstance(head, MTP)
        self.d2t = getattr(head, "d2t", None)  # EAGLE-3 draft vocabulary -> target ids; None: the full vocabulary
        self.depths = len(head.layers) if self.is_mtp else 1
        self.capture_layers = () if self.is_mtp else tuple(head.capture_layers)
        self.cache: KVCache | None = None

    def start(self, seqs, params, max_len, num_slots) -> None:
        cfg = self.target.config
        if self.cache is None or self.cache.num_slots < num_slots or self.cache.max_len < max_len:
            self.cache = KVCache(self.head.num_cache_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                 self.target.dtype, self.target.device, first_layer=cfg.num_hidden_layers)
            # Target features by (slot, position): one batched write per target forward, one gather per round.
            # EAGLE-3's are stored unfused and fused only on the rows a round drafts from, so a step that does not
            # speculate (adaptive k = 0) pays for a copy, not for the fusing matmul.
            width = cfg.hidden_size * (1 if self.is_mtp else len(self.capture_layers))
            self.features = torch.zeros(num_slots, max_len, width, dtype=self.target.dtype, device=self.target.device)
        self.params = params
        self.frontier = {s.index: 0 for s in seqs}
        self.pending: list = []  # target states observed but not yet written into `features` (`observe`)
        self.pending_bytes = 0

    def observe(self, seqs, out: TrunkOutput, starts, valid) -> None:
        """Hold on to this forward's states; they are written into `features` in one batch before the next draft.
        While the adaptive controller has speculation off nothing reads them, and writing them every step cost
        2-5 % of a tiny-model decode step at batch 64 (the write ~40 us of ~3.5 ms, EAGLE-3's three layers ~100
        us); a rollout that never speculates never writes them (`start` drops what the last one held). Past
        MAX_PENDING_BYTES they are written anyway, which bounds the memory held."""
        parts = (out.hidden,) if self.is_mtp else tuple(out.layers[i] for i in self.capture_layers)
        self.pending.append(([s.slot for s in seqs], starts, valid, parts))
        self.pending_bytes += sum(p.numel() * p.element_size() for p in parts)
        if self.pending_bytes > MAX_PENDING_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            write_rows(self.features, self.pending)
        self.pending, self.pending_bytes = [], 0

    def catch_up_rows(self, slots: list[int], starts: list[int], counts: list[int], T: int) -> Tensor:
        """The target states [B, T, width] at positions c .. c + T - 1 of the sequence in each of `slots` (c: its
        frontier; rows past its count are padding, which nothing reads on).

        While speculation runs, the one forward observed since the last draft, the verify, holds every row this
        catch-up reads: it fed positions L - 1 .. L - 1 + k, of which the accepted ones, L - 1 .. L' - 2, are the
        catch-up of a one-depth head (frontier L - 1), and none is read again (the frontier moves past them). Those
        rows are then taken from that forward's output, and neither written into `features` nor gathered back out
        of it (at 64 sequences of the main job that write and gather would be about 4 % of a k = 3 step).
        Anything else (several forwards since the last draft: plain steps, a prefill; a deeper head, which reads
        rows again) goes through `features`."""
        device = self.target.device
        if len(self.pending) == 1 and self.depths == 1:
            f_slots, f_starts, f_valid, parts = self.pending[0]
            slot_row = np.full(max(max(f_slots), max(slots)) + 1, -1)
            slot_row[f_slots] = np.arange(len(f_slots))
            index = slot_row[slots]  # each sequence's row in that forward, -1 where it had none
            c, n = np.asarray(starts), np.asarray(counts)
            f_start = np.asarray(f_starts)[index]
            if (index >= 0).all() and (c >= f_start).all() and (c + n <= f_start + np.asarray(f_valid)[index]).all():
                self.pending, self.pending_bytes = [], 0
                rows = spans(c - f_start, T, parts[0].shape[1] - 1, device)
                index = long_tensor(index, device)[:, None]
                return joined([part[index, rows] for part in parts], -1)
        self.flush()
        rows = spans(starts, T, self.features.shape[1] - 1, device)
        return self.features[long_tensor(slots, device)[:, None], rows]

    def step(self, depth: int, hidden: Tensor, ids: Tensor, positions: Tensor, view) -> Tensor:
        return self.head.state(hidden, ids, positions, self.target.embed, view, layer=depth)

    def greedy_mtp(self) -> bool:
        """Drafts are an MTP head's argmax (q one-hot): what `MTP.draft` computes."""
        return self.is_mtp and (not self.sample or self.params.greedy)

    def logits(self, state: Tensor) -> Tensor:
        """The head's logits for the rows it drafts from (each sequence's last): not for every catch-up row."""
        return self.head.logits(state, self.target.lm_head) if self.is_mtp else self.head.logits(state)

    def propose(self, seqs, k: int) -> Drafts:
        B, device = len(seqs), self.target.device
        budget = [max(0, min(k, s.remaining - 1)) for s in seqs]
        width = max(budget)
        if width == 0:  # every sequence is one token from its end: nothing to draft, the frontier stays
            return Drafts.none(B)
        starts = [self.frontier[s.index] for s in seqs]
        counts = [s.length - 1 - c for s, c in zip(seqs, starts)]  # positions c .. L-2
        T = max(counts)
        slots = [s.slot for s in seqs]
        hidden = self.catch_up_rows(slots, starts, counts, T)
        if not self.is_mtp:
            hidden = self.head.fc(hidden)
        last = long_tensor([n - 1 for n in counts], device)
        # The tokens the catch-ups read, from position c + 1 on, each round's drafts written after them as they
        # come (depth j reads columns j .. j + T - 1, zero past the end): one tensor built once, where a Python
        # list per sequence grew by every round's drafts, read back from the device every round.
        ahead = ahead_tokens(seqs, starts, counts, T + self.depths - 1, device)
        columns, probs = [], []
        rounds = max(width, self.depths)
        # Every depth runs its catch-up even when k is below the number of depths (adaptive k=1 on a 2-layer MTP):
        # the frontier below moves for all depths, and a depth skipped here would miss its keys from then on.
        for j in range(rounds):
            depth = min(j, self.depths - 1)
            if j < self.depths:  # catch-up rows c..L-2 for this depth, tokens j+1 ahead
                ids = ahead if ahead.shape[1] == T else ahead[:, j : j + T].contiguous()
                view = self.cache.view(slots, starts, T)
                if depth == self.depths - 1 and self.greedy_mtp():
                    # The last depth's catch-up and every round after it in one kernel call, where it applies.
                    chained = self.head.draft(hidden, ids, last, rounds - j, self.target.lm_head,
                                              self.target.model.embed_tokens.weight, view)
                    if chained is not None:
                        columns.append(chained)
                        probs += [None] * (width - j)
                        break
                rows_b = torch.arange(B, device=device)
                if depth == self.depths - 1 and T >= STORE_ONLY_FROM:
                    # Only the last rows' states are read on (the chain starts there): keys and values for every
                    # row, then the layer on the last rows alone (`STORE_ONLY_FROM`).
                    self.head.store(hidden, ids, view.positions, self.target.embed, view, layer=depth)
                    one = self.cache.view(slots, [c + n - 1 for c, n in zip(starts, counts)], 1)
                    state = self.step(depth, hidden[rows_b, last, None], ids[rows_b, last, None], one.positions,
                                      one)[:, 0]
                else:
                    hidden = self.step(depth, hidden, ids, view.positions, view)
                    state = hidden[rows_b, last]
            else:  # chain the last depth one position further, on its own previous state
                pos = [c + n + (j - self.depths) for c, n in zip(starts, counts)]
                ids = tokens[:, None]  # the token after position pos + depth is the previous round's draft
                view = self.cache.view(slots, pos, 1)
                state = self.step(depth, state[:, None], ids, view.positions, view)[:, 0]
            logits = self.logits(state)
            tokens, q = choose_mapped(logits, self.d2t, self.target.config.vocab_size,
                                      self.params, seqs, self.sample)
            if j < width:
                probs.append(q)
            columns.append(tokens[:, None])
            if j + 1 < self.depths:  # the next depth's catch-up reads this draft after each sequence's tokens
                ahead.scatter_(1, long_tensor([n + j for n in counts], device)[:, None], tokens[:, None])
        for s in seqs:  # depth i is final up to L-2-i, so everything from L-D on is redone next round
            self.frontier[s.index] = max(s.length - self.depths, 0)
        stacked = torch.stack(probs, 1) if probs and probs[0] is not None else None
        table = joined(columns, 1)
        if table.shape[1] > width:  # a deeper head's catch-ups drafted past k
            table = table[:, :width]
        if min(budget) < width:  # drafts past a sequence's budget read as padding
            table = table.masked_fill(torch.arange(width, device=device) >= long_tensor(budget, device)[:, None], 0)
        return Drafts(None, stacked, table, budget)


def ahead_tokens(seqs, starts: list[int], counts: list[int], width: int, device) -> Tensor:
    """[B, width] int64: sequence b's tokens at positions starts[b] + 1 .. starts[b] + counts[b] (its last), then
    zeros."""
    rows = []
    for s, c in zip(seqs, starts):
        P = len(s.prompt)
        rows += s.prompt[c + 1 :] + s.output if c + 1 < P else s.output[c + 1 - P :]
    table = np.zeros((len(seqs), width), dtype=np.int64)
    table[np.arange(width) < np.asarray(counts)[:, None]] = rows  # row-major: each sequence's tokens in order
    return long_tensor(table, device)


class FeatureRecorder(Proposer):
    """Proposes nothing; keeps, per sequence and position, what every target forward computed: the final hidden
    state followed by the outputs of the `capture` layers (concatenated, [..., (1 + len(capture)) * H])."""

    def __init__(self, target: CausalLM, capture: tuple[int, ...]):
        self.target = target
        self.capture_layers = tuple(dict.fromkeys(capture))  # the runner records these; duplicates once

    def start(self, seqs, params, max_len, num_slots) -> None:
        # One buffer for the whole call, allocated here (outside inference mode, so training can read it), written
        # in place by each forward: many small per-step copies would fragment the heap (seen: 7 GB RSS for 0.6 GB).
        width = (1 + len(self.capture_layers)) * self.target.config.hidden_size
        self.feats = torch.zeros(len(seqs), max_len, width, dtype=self.target.dtype, device=self.target.device)

    def observe(self, seqs, out, starts, valid) -> None:
        parts = (out.hidden, *(out.layers[i] for i in self.capture_layers))
        write_rows(self.feats, [([s.index for s in seqs], starts, valid, parts)])

    def features(self, length: int) -> TrunkOutput:
        """The recorded features of the first `length` positions as a right-padded `TrunkOutput` [N, length, H]
        (a completion's last token was never fed to the target: its row stays zero, as does padding; no loss reads
        either)."""
        parts = self.feats[:, :length].chunk(1 + len(self.capture_layers), -1)
        return TrunkOutput(parts[0], dict(zip(self.capture_layers, parts[1:])))


def hidden_state_proposer(spec, target: CausalLM, drafter) -> HiddenStateProposer:
    """The proposer of a head that drafts from `target`'s hidden states (a registry entry's `proposer`); a head
    built for another vocabulary or hidden size raises before any generation."""
    if drafter.target_config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.target_config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size})")
    if drafter.target_config.hidden_size != target.config.hidden_size:
        raise ValueError(f"{spec.method} drafter was built for hidden size {drafter.target_config.hidden_size}, "
                         f"the target has {target.config.hidden_size}")
    return HiddenStateProposer(target, drafter.to(target.device, target.dtype), spec.draft_sampling)
