"""Drafting by lookup in the earlier rollouts of the same prompt."""
