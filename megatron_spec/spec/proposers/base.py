"""The proposer interface every drafter implements, and the draft-token choice shared by model drafters."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...models.decoder import TrunkOutput
from ...models.host import float_tensor
from ..sampling import processed_logprobs, sample_inverse_cdf


@dataclass
class Drafts:
    tokens: list[list[int]]
    """Drafted tokens per sequence (ragged: a drafter may propose fewer than k, or none)."""
    probs: Tensor | None = None
    """[B, k, V] drafter distributions q when drafts were sampled; None for deterministic drafts (q one-hot)."""


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
    u = float_tensor([s.uniforms(1)[0] for s in seqs], q.device)
    return sample_inverse_cdf(q, u), q
