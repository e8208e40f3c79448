"""The embedded generator: `LLMEngine` on its own copy of the policy (and drafter), refit every step.

It keeps separate weights on purpose, as vLLM does at scale: the refit path is then exercised for real, and a test
can prove that after a refit the engine's weights equal the trainer's.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

from ..drafters.config import SpecConfig
from ..drafters.proposer import Proposer
from ..engine import LLMEngine
from ..interfaces import Completion, SamplingParams
from ..refit import load_buckets


class EmbeddedGenerator:
    """The `Generator` of one process (`megatron_spec.interfaces`), the one that runs the whole-step gate."""

    supports_step_gate = True

    def __init__(self, policy_model, drafter=None, spec: SpecConfig | None = None, max_num_seqs: int = 256,
                 own: bool = False, record_routing: bool = False):
        """`own`: keep `policy_model` and `drafter` themselves instead of copies (they were loaded for it alone);
        `record_routing`: completions carry their MoE routing (`grpo.routing_replay`)."""
        take = (lambda m: m) if own else copy.deepcopy
        self.model = take(policy_model).eval().requires_grad_(False)
        self.drafter = take(drafter).eval().requires_grad_(False) if drafter is not None else None
        self.engine = LLMEngine(self.model, max_num_seqs=max_num_seqs, spec=spec, drafter=self.drafter,
                                record_routing=record_routing)

    @classmethod
    def from_rl(cls, cfg, model, drafter=None) -> "EmbeddedGenerator":
        return cls(model, drafter, cfg.spec, max_num_seqs=cfg.grpo.prompts_per_step * cfg.grpo.group_size,
                   record_routing=cfg.grpo.routing_replay)

    def update_weights(self, stream) -> int:
        """Load a bucketed `(hf_name, tensor)` stream (policy and `drafter.` tensors); returns bytes loaded."""
        return load_buckets(self.model, self.drafter, stream)

    def refit_in_flight(self, load, version: int):
        """Run `load()` (a refit of this generator's weights) from another thread while the engine may be
        generating: between two of its decoding steps (at once when none runs), the running rollouts continuing
        under the new weights with their tokens recorded as `version`'s (`LLMEngine.refit`); returns what `load`
        returned."""
        return self.engine.refits.refit(self.engine, load, version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    @contextmanager
    def speculation(self, enabled: bool):
        """With `enabled` False, the engine inside the block generates as `spec=null` runs it (no proposer,
        controller or drafts); the configured one is back after it."""
        if enabled:
            yield
            return
        e = self.engine
        saved = e.proposer, e.controller, e.k_max
        e.proposer, e.controller, e.k_max = Proposer(), None, 0
        try:
            yield
        finally:
            e.proposer, e.controller, e.k_max = saved

    def sleep(self) -> None:
        """Free the KV cache between rollouts (weights stay: a drafter is never lost across sleep)."""
        self.engine.cache = None

    def close(self) -> None:
        """Nothing outside this process to release (a vLLM generator shuts its engine processes down here)."""

    def wake(self) -> None:
        """Nothing to restore on CPU: the next `generate` sizes a new KV cache."""
