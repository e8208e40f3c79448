"""What a caller asks of `LLMEngine.generate` and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..speculative.sampling import validate_sampling


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""
    max_tokens: int = 64
    """New tokens per completion at most (fewer if a stop token or the context end comes first)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a completion (the model's EOS always does unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS (benchmarks that need a fixed number of new tokens)."""
    seed: int = 0
    """Base seed; completion i of a `generate` call draws from its own generator seeded by (seed, i)."""

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    token_ids: list[int]
    """Generated tokens (the prompt excluded; a final stop token included)."""
    logprobs: list[float]
    """Log-prob of each generated token under the processed target distribution (what the trainer recomputes)."""
    finish_reason: str
    """'stop' (a stop token) or 'length' (max_tokens or the end of the context)."""
    prompt_len: int = 0
    """Number of prompt tokens."""
    spec: dict = field(default_factory=dict)
    """Speculation statistics of this completion (drafted, accepted, per position); empty without speculation."""
    versions: list[int] = field(default_factory=list)
    """The policy version of the weights that sampled each generated token (in-flight refits switch versions
    between two tokens; a rollout may then span several); empty where the generator does not record it."""
    routing: np.ndarray | None = None
    """MoE routing replay (`grpo.routing_replay`): [prompt_len + len(token_ids) - 1, MoE layers, top_k] int16, the
    experts each MoE layer routed each input position to (prompt and generated tokens; the last generated token is
    never an input), in the policy's forwards that produced the tokens (for a speculative step, the verification
    forward's rows of the accepted tokens; after an in-flight refit, the new weights' forward over the prefix, which
    the later tokens read). None where not recorded. A numpy array: a completion crosses process pipes (the Megatron
    recipe's generator process), where torch would send a tensor's storage as a shared file descriptor."""
