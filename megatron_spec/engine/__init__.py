"""Single-machine rollout engine: continuous batching, slotted KV cache with rollback, speculative decoding."""

from .engine import LLMEngine
from .params import Completion, SamplingParams

__all__ = ["LLMEngine", "SamplingParams", "Completion"]
