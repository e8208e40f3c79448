"""The two contracts the RL loop drives, written as types: `Policy` (the trainer) and `Generator` (the rollout
engine), and the data that crosses them (`Batch`, `DrafterInputs`, `Rollouts`, and the engine's `SamplingParams` /
`Completion`).

The loop (`rl/loop.py`, and the Ray driver that subclasses it) calls only what these protocols name, so it never
knows which implementation it holds; `rl/backends.py` maps config names to the implementations and a test checks
each one against its protocol. This module imports torch and the core's own types, nothing of the distributed
stacks, so every side can import it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Iterable, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from .engine.params import Completion, SamplingParams
from .models.decoder import TrunkOutput

__all__ = ["Batch", "Completion", "DrafterInputs", "Generator", "Policy", "Rollouts", "SamplingParams", "StepGate",
           "no_step_gate"]


@dataclass
class Batch:
    """A step's rollouts as the trainer reads them; made on the host by the loop, moved once by each trainer."""

    input_ids: Tensor
    """[B, T] prompt + completion, right-padded."""
    mask: Tensor
    """[B, T] True at completion tokens (what the loss and the drafter learn)."""
    advantages: Tensor | None = None
    """[B] per-sequence advantage."""
    old_logprobs: Tensor | None = None
    """[B, T-1] log-probs of token t+1 under the policy before this update (from the logprob stage). None:
    `train_step` takes them from its own forward, detached, and fills them in (`grpo.fold_logprob`)."""
    behaviour_logprobs: Tensor | None = None
    """[B, T-1] the engine's log-probs of the sampled tokens when the rollouts came from an older policy version
    than the one being trained (async GRPO): the loss then weighs each token by the importance ratio old /
    behaviour as `grpo.rollout_correction` says (`grpo.truncated_is_weights`). None: the rollouts are on-policy,
    no correction."""
    routing: Tensor | None = None
    """[B, T, MoE layers, top_k] the experts the rollouts routed each position to (-1: route freely), which the
    trainer's forwards replay (`grpo.routing_replay`, `models.routing`); None: each forward routes by itself."""

    def to(self, device: torch.device) -> "Batch":
        """This batch with every tensor on `device` (itself where they already are)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), mask=move(self.mask), advantages=move(self.advantages),
                       old_logprobs=move(self.old_logprobs), behaviour_logprobs=move(self.behaviour_logprobs),
                       routing=move(self.routing))

    def select(self, rows: list[int], length: int) -> "Batch":
        """The micro-batch of `rows`, cropped to its first `length` positions."""
        idx = torch.tensor(rows, device=self.input_ids.device)
        per_token = lambda t: None if t is None else t[idx, : length - 1]  # noqa: E731  ([B, T-1] fields)
        return Batch(self.input_ids[idx, :length], self.mask[idx, :length],
                     None if self.advantages is None else self.advantages[idx],
                     per_token(self.old_logprobs), per_token(self.behaviour_logprobs),
                     routing=None if self.routing is None else self.routing[idx, :length])


class DrafterInputs(NamedTuple):
    """What the drafter update needs from one micro-batch's policy forward, all detached."""

    input_ids: Tensor
    mask: Tensor
    out: TrunkOutput
    logits: Tensor

    def rows(self, index: slice) -> "DrafterInputs":
        """The rows `index` selects (a view, no copy)."""
        out = TrunkOutput(self.out.hidden[index], {i: h[index] for i, h in self.out.layers.items()})
        return DrafterInputs(self.input_ids[index], self.mask[index], out, self.logits[index])

    def copy_to(self, device) -> "DrafterInputs":
        """A copy on `device` that shares no storage with this one (a checkpoint then holds just these tensors)."""
        def copy(t: Tensor) -> Tensor:
            return t.to(device, copy=True)

        out = TrunkOutput(copy(self.out.hidden), {i: copy(h) for i, h in self.out.layers.items()})
        return DrafterInputs(copy(self.input_ids), copy(self.mask), out, copy(self.logits))


@dataclass
class Rollouts:
    """One step's completions (in prompt order) and how old the policy that generated them is."""

    outs: list[Completion]
    """The generator's outputs, one per prompt (token ids, behaviour log-probs, each token's policy version where
    the generator records it, speculation stats)."""
    lag: int = 0
    """Policy versions between the weights that generated the oldest token and the weights being trained (0:
    on-policy). With in-flight updates a rollout's tokens may come from several versions; each token's behaviour
    log-prob is its own version's, which is what the loss's importance ratios read."""
    metrics: dict = field(default_factory=dict)
    """What the producer adds to the step's metrics (weight sync bytes / seconds, policy version, restarts)."""
    ages: list[int] | None = None
    """Per rollout, policy versions between the weights that generated its oldest token and the weights being
    trained (`grpo.max_trajectory_age` drops groups by them); None: every rollout is `lag` old."""

    @property
    def row_ages(self) -> list[int]:
        """Each rollout's age: `ages`, or `lag` for every rollout where the producer gives none."""
        return self.ages if self.ages is not None else [self.lag] * len(self.outs)


class StepGate(Protocol):
    """Speculation switched off for one step (the whole-step gate, `speculative.adaptive.WholeStepGate`), on both
    sides at once: the generator then generates and the trainer trains as a run without speculation would."""

    supports_step_gate: bool
    """Whether `speculation(False)` can run a plain step; the loop gates only a pair where both sides can."""

    def speculation(self, enabled: bool) -> AbstractContextManager[None]:
        """Inside the block: speculation as configured (`enabled`) or off (no drafts; the trainer's drafter neither
        trains nor measures). An implementation without the gate accepts only True (`no_step_gate`)."""


@runtime_checkable
class Policy(StepGate, Protocol):
    """The trainer: GRPO updates of the policy, and of its drafter online, on batches the loop makes."""

    trains_drafter_online: bool
    """Whether the next `train_step` updates a drafter on the step's forwards (False inside `speculation(False)`)."""

    @classmethod
    def from_rl(cls, cfg, model, drafter) -> "Policy":
        """Built from the run's config and the loaded policy model and drafter (None: it reads the files)."""

    def logprobs(self, batch: Batch) -> Tensor:
        """[B, T-1] the processed log-probs of the batch's next tokens (0 outside the mask), on the host."""

    def train_step(self, batch: Batch) -> dict:
        """One GRPO update (and the drafter's online update), returning its metrics; fills `batch.old_logprobs` in
        when they were None. A trainer that trains its drafter by a budget also takes `drafter_extra` (rows only the
        drafter learns from) and `drafter_budget_s`; the loop passes them only when a step has them."""

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The policy's full tensors by HF name, then the drafter's under the `drafter.` prefix."""

    def state_dict(self) -> dict:
        """Everything a checkpoint needs (weights, optimizers)."""

    def load_state_dict(self, state: dict) -> None:
        """Back to a `state_dict`."""


@runtime_checkable
class Generator(StepGate, Protocol):
    """The rollout engine: completions of the loop's prompts under weights refit from the trainer."""

    @classmethod
    def from_rl(cls, cfg, model, drafter) -> "Generator":
        """Built from the run's config and the loaded policy model and drafter (None: it reads the files)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt: tokens, their log-probs under the processed target distribution, finish
        reason, speculation statistics."""

    def update_weights(self, stream: Iterable[list[tuple[str, Tensor]]]) -> int:
        """Load a bucketed `(hf_name, tensor)` stream, policy and drafter together; the bytes loaded."""

    def sleep(self) -> None:
        """Release what the engine holds between rollouts (its KV cache)."""

    def wake(self) -> None:
        """Take back what `sleep` released, before the next rollouts."""

    def close(self) -> None:
        """Shut down what it runs outside this process, when the run ends."""


def no_step_gate(owner, enabled: bool) -> AbstractContextManager[None]:
    """`speculation` of an implementation without the whole-step gate: speculation as configured, and an error
    naming it when asked for a plain step (the loop asks only where `supports_step_gate`)."""
    if not enabled:
        raise NotImplementedError(f"{type(owner).__name__} cannot switch speculation off for a step "
                                  "(supports_step_gate is False)")
    return nullcontext()
