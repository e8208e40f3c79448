"""One-question experiments, their records and the lab notebook: not installed, not in the default test suite, and
never imported by `megatron_spec/` or `tests/` (see research/README.md)."""
