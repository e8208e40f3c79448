"""A smaller causal LM of the target's tokenizer as the drafter."""
