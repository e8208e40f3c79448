"""`SpecConfig`: how the engine speculates. Field names follow vLLM's `speculative_config`, so the same config
drives the vLLM backend unchanged (our extra fields are dropped there)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_model", "mtp", "eagle3", "ngram", "history")


@dataclass
class SpecConfig:
    method: str
    """Drafter: one of `METHODS`."""
    num_speculative_tokens: int = 3
    """k: tokens drafted per verify step (the adaptive controller's upper bound when `adaptive`)."""
    model: str | None = None
    """Drafter checkpoint directory (draft_model: an HF-layout model; mtp / eagle3: a saved drafter)."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram the ngram and history drafters match."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram they try first."""
    adaptive: bool = False
    """Pick k (0 = plain decoding) every step from the batch size, measured acceptance and measured costs."""
    draft_sampling: bool = False
    """Model drafters sample their drafts from their own processed distribution (q enters verification) instead
    of proposing their argmax (q = one-hot)."""
    history_docs_per_prompt: int = 16
    """History drafter: finished rollouts remembered per prompt across `generate` calls (RL steps)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: known are {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1 with method {self.method!r}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )

    def vllm(self) -> dict:
        """The `speculative_config` dict vLLM takes."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model:
            out["model"] = self.model
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        return out
