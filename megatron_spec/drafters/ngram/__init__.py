"""Drafting by n-gram lookup: in the sequence itself (ngram) and in earlier rollouts (history)."""
