"""megatron-spec: GRPO post-training of LLMs with lossless speculative-decoding rollouts."""

__version__ = "0.1.0"
