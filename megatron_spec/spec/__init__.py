"""The speculative core: processed target distribution, sampling, verification, proposers, adaptive control."""

from .sampling import processed_logprobs, sample_inverse_cdf, validate_sampling

__all__ = ["processed_logprobs", "sample_inverse_cdf", "validate_sampling"]
