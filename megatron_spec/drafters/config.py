"""`SpecConfig`: how the engine speculates. Field names follow vLLM's `speculative_config`, so the same config
drives the vLLM backend unchanged (our extra fields are dropped there)."""

from __future__ import annotations

from dataclasses import dataclass

from .registry import drafter_method


@dataclass
class SpecConfig:
    method: str
    """Drafter: a name in the drafter registry (`spec.registry.method_names()`)."""
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
        drafter_method(self.method)  # an unknown name raises, listing the known ones
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1 with method {self.method!r}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )

    def vllm(self) -> dict | None:
        """The `speculative_config` dict vLLM takes (the method's vLLM name and options from the registry); None
        for a method with no vLLM counterpart."""
        method = drafter_method(self.method)
        if method.vllm_method is None:
            return None
        out = {"method": method.vllm_method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model:
            out["model"] = self.model
        if method.vllm_options is not None:
            out.update(method.vllm_options(self))
        return out
