"""Multi-token prediction heads (Megatron layout): the module, and its vLLM model and config."""
