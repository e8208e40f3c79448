"""How many operators our eager engine and trainer launch, counted on the code itself when a prediction needs them.

A 0.8 M-parameter model does almost no arithmetic per operator, so on the CPU its step time is mostly the fixed
cost of launching operators (Python, the dispatcher, allocation: a few microseconds each) and the engine's Python
work per sequence; the roofline alone predicted half of the measured `gen` time of the tiny model. The harness
therefore needs operator counts, and takes them from the code as it is: `op_census` runs the real engine, proposers
and trainer on random-weight models of the predicted architecture and counts every ATen operator that reaches the
dispatcher (views, in-place updates and backward included). Nothing here is a hand-kept table, so a change to the
engine or the trainer changes the counts (and the prediction) instead of breaking a test.

What the model assumes about the code, and `research/tests/sim_cpu/test_counts.py` checks exactly on it, is only the shape
of each count, so that two censuses fix it:

    engine step       = target forward + sampling (verify or plain) + k x draft forward + per-step drafter work
                        (a draft model's forward also reads each draft token back: + sequences x per-sequence ops)
    logprob / train   = fixed + n x per micro-batch, for n length-bucketed micro-batches (each but the first
                        cropped; a micro-batch of a single row launches a few more, which no realistic budget makes
                        common), counted with the run's fold / shared-prompt / online-drafter settings; with
                        shared prompts + (prompts - 2) x per prompt group (the prefix pass's per-prompt work)
    logprob stage     = fixed + rows x per rollout (batch assembly and the mismatch metric)

Counted at batch 8 (a batch of 1 launches two operators fewer per layer: its KV rows are a slice, not an index).
Dense models only: a mixture-of-experts layer's count depends on the experts a batch touches, which this harness
never validated against timings, so it refuses MoE models. Counting takes a few seconds per architecture (cached for
the process); torch is imported by `op_census`, inside its functions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache

from megatron_spec.models.config import ModelConfig

from . import op_census

BATCH = 8
METHOD = {"mtp": "mtp", "eagle3": "eagle3", "model": "draft_model"}
"""Simulator drafter kinds -> the engine's speculative methods (n-gram drafting launches no draft forward)."""


@dataclass(frozen=True)
class Affine:
    fixed: float
    """Operators whatever the count."""
    per: float
    """Operators per unit (micro-batch, rollout, draft)."""

    def __call__(self, n: float) -> float:
        return self.fixed + self.per * n

    @classmethod
    def through(cls, x1: float, y1: float, x2: float, y2: float) -> "Affine":
        per = (y2 - y1) / (x2 - x1)
        return cls(y1 - per * x1, per)


@dataclass(frozen=True)
class EngineCounts:
    forward: float
    """One target forward through the KV cache, embedding to logits."""
    plain_sample: float
    """Sampling after a plain decode forward."""
    sample: float
    """Sampling, verification and acceptance after a verify forward (0 without a drafter)."""
    draft_forward: float
    """One draft forward, the draft choice included (0 without a drafter)."""
    draft_step: float
    """A drafter's work once per verify step outside its forwards (hidden-state drafters store the target's
    features)."""
    draft_seq: float
    """Per sequence per draft forward (a draft model reads each draft token back into Python)."""


def _key(m: ModelConfig) -> str:
    if m.is_moe:
        raise ValueError(f"the CPU harness counts operators of dense models only ({m.model_type} with "
                         f"{m.num_experts} experts is MoE: its counts depend on the experts a batch touches)")
    return json.dumps(dataclasses.asdict(m), sort_keys=True)


def _config(key: str) -> ModelConfig:
    return ModelConfig(**json.loads(key))


@lru_cache(maxsize=None)
def _engine(key: str, kind: str | None) -> EngineCounts:
    cfg = _config(key)
    plain = op_census.engine_step(cfg, BATCH)
    if kind is None:
        return EngineCounts(plain.forward, plain.sample, 0.0, 0.0, 0.0, 0.0)
    method = METHOD[kind]
    k3, k2 = op_census.engine_step(cfg, BATCH, method, 3), op_census.engine_step(cfg, BATCH, method, 2)
    per_draft = k3.propose - k2.propose
    seq = 0.0
    if kind == "model":  # the per-sequence part: the same step at twice the batch
        wide = op_census.engine_step(cfg, 2 * BATCH, method, 3)
        seq = (wide.propose - k3.propose) / (3 * BATCH)
    return EngineCounts(forward=plain.forward, plain_sample=plain.sample, sample=k3.sample,
                        draft_forward=per_draft - BATCH * seq, draft_step=k3.propose - 3 * per_draft, draft_seq=seq)


def engine(m: ModelConfig, kind: str | None = None) -> EngineCounts:
    """Counts of our engine running `m`, speculating with drafter `kind` (mtp, eagle3, model: the tiny-draft preset
    with `m`'s vocabulary) or plain (None, or ngram: no draft forward)."""
    return _engine(_key(m), kind if kind in METHOD else None)


@dataclass(frozen=True)
class TrainerCounts:
    logprob: Affine
    """The recompute `logprobs` per micro-batch count (with two prompt groups when prompts are shared)."""
    train: Affine
    """One `train_step` per micro-batch count (with two prompt groups when prompts are shared)."""
    logprob_group: float
    """Operators per further prompt group of a shared-prompt `logprobs` (0 unshared)."""
    train_group: float
    """Operators per further prompt group of a shared-prompt `train_step` (0 unshared)."""

    CENSUS_GROUPS = 2  # the censuses' 4 rows hold 2 prompts when shared


@lru_cache(maxsize=None)
def _trainer(key: str, fold: bool, shared: bool, drafter: str | None) -> TrainerCounts:
    cfg = _config(key)
    method = METHOD.get(drafter) if drafter else None
    one = op_census.trainer_pass(cfg, budget=0, fold=fold, shared=shared, drafter=method)
    two = op_census.trainer_pass(cfg, budget=32, fold=fold, shared=shared, drafter=method)
    if (one.micro_batches, two.micro_batches) != (1, 2):
        raise RuntimeError(f"trainer census expected 1 and 2 micro-batches, got {one.micro_batches}, "
                           f"{two.micro_batches}: the trainer's micro-batch rule changed")
    # With shared prompts the prefix pass does some work per distinct prompt: one more group (6 rows, 3 prompts).
    more = op_census.trainer_pass(cfg, batch=6, budget=0, fold=fold, shared=shared, drafter=method) if shared else one
    return TrainerCounts(Affine.through(1, one.logprob, 2, two.logprob), Affine.through(1, one.train, 2, two.train),
                         more.logprob - one.logprob, more.train - one.train)


def logprob_ops(m: ModelConfig, micro_batches: int, shared: bool, groups: int = 2) -> float:
    """Operators of the trainer's recompute `logprobs` over `micro_batches` micro-batches; `groups`: distinct
    prompts when they are shared."""
    c = _trainer(_key(m), False, shared, None)
    return c.logprob(micro_batches) + c.logprob_group * (groups - c.CENSUS_GROUPS)


def train_ops(m: ModelConfig, micro_batches: int, fold: bool, shared: bool, drafter: str | None = None,
              groups: int = 2) -> float:
    """Operators of one `train_step` (forward, backward, clipping, AdamW; the online drafter update when `drafter`
    trains in the step) over `micro_batches` micro-batches; `groups`: distinct prompts when they are shared."""
    c = _trainer(_key(m), fold, shared, drafter)
    return c.train(micro_batches) + c.train_group * (groups - c.CENSUS_GROUPS)


@lru_cache(maxsize=None)
def _assembly() -> Affine:
    return Affine.through(8, op_census.batch_assembly(8), 16, op_census.batch_assembly(16))


def batch_ops(rows: float) -> float:
    """Operators of the logprob stage besides the recompute: assembling the padded batch and the mismatch metric."""
    return _assembly()(rows)


@lru_cache(maxsize=None)
def _elements(key: str) -> float:
    return op_census.activation_elements(_config(key))


def activation_elements(m: ModelConfig) -> float:
    """Floats elementwise operators read plus write per token per decoder layer in a forward of our layer code
    (norms, RoPE, SwiGLU, residual adds), counted (`op_census.activation_elements`). On a GPU this traffic hides
    under the weight stream; on the CPU a 128-wide model's activations cost as much as its products once a batch
    has a few hundred tokens."""
    return _elements(_key(m))
