"""The proposer interface every drafter implements, and the draft-token choice shared by model drafters."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from ..models.decoder import TrunkOutput
from ..models.host import float_tensor, long_tensor
from ..speculative.sampling import processed_logprobs, sample_inverse_cdf, uniforms


class Drafts:
    """What a proposer drafted for each sequence of a step: ragged token lists, or one padded tensor."""

    def __init__(self, tokens: list[list[int]] | None, probs: Tensor | None = None, table: Tensor | None = None,
                 lengths: list[int] | None = None):
        self._tokens = tokens
        """Drafted tokens per sequence (ragged: a drafter may propose fewer than k, or none); None where the
        drafter gave them as `table` only (`tokens` then reads them back)."""
        self.probs = probs
        """[B, k, V] drafter distributions q when drafts were sampled; None for deterministic drafts (q one-hot)."""
        self.table = table
        """[B, k] the same drafts as one tensor on the model's device, right-padded with 0, k the longest: what a
        drafter running on the device made them as. The engine feeds and verifies them as they are and reads them
        back once, with the verdict, instead of once per drafting round (a host sync on a GPU) into a Python list
        per sequence."""
        self.lengths = lengths if lengths is not None else [len(d) for d in tokens]
        """Drafts per sequence."""

    @classmethod
    def none(cls, batch: int) -> "Drafts":
        """No drafts for any of `batch` sequences (plain decoding)."""
        return cls([[] for _ in range(batch)], lengths=[0] * batch)

    @property
    def tokens(self) -> list[list[int]]:
        """Each sequence's drafts as a list (read back from `table` where they are only there)."""
        if self._tokens is None:
            self._tokens = [row[:n] for row, n in zip(self.table.tolist(), self.lengths)]
        return self._tokens

    def padded(self, device) -> Tensor:
        """`table`, or `tokens` right-padded with 0 into one [B, k] tensor (k: the most drafts of a sequence)."""
        if self.table is not None:
            return self.table
        k = max(self.lengths, default=0)
        if k == 0:
            return long_tensor(np.zeros((len(self.lengths), 0)), device)
        return long_tensor([d + [0] * (k - len(d)) for d in self._tokens], device)


class Proposer:
    """Proposes up to k tokens per running sequence; sees every target forward to keep its own state current."""

    capture_layers: tuple[int, ...] = ()
    """Target layers whose outputs this drafter reads (the runner records them)."""

    def start(self, seqs, params, max_len: int, num_slots: int) -> None:
        """A `generate` call begins: reset per-sequence state (the history drafter keeps what it learned)."""

    def observe(self, seqs, out: TrunkOutput, starts: list[int], valid: list[int]) -> None:
        """After a target forward: sequence b fed tokens at positions starts[b].., the first valid[b] are kept."""

    def propose(self, seqs, k: int) -> Drafts:
        raise NotImplementedError

    def finish(self, seq) -> None:
        """A sequence completed."""


def choose_drafts(logits: Tensor, params, seqs, sample: bool) -> tuple[Tensor, Tensor | None]:
    """Draft tokens [B] from drafter logits [B, V]: the argmax (q one-hot), or a sample from the drafter's
    processed distribution under the request's sampling settings (q returned [B, V])."""
    if not sample or params.greedy:
        return logits.argmax(-1), None
    q = processed_logprobs(logits, params.temperature, params.top_k, params.top_p).exp()
    u = float_tensor(uniforms(seqs, 1)[:, 0], q.device)
    return sample_inverse_cdf(q, u), q
