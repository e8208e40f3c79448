"""Drafting by n-gram lookup in the sequence itself (prompt lookup)."""
