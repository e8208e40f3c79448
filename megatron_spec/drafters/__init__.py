"""Drafters: one folder per method (its module, proposer, online loss and format adapters), the registry that names
them (`drafters.registry`), the proposer interface they share (`drafters.proposer`), and the one drafter trainer.

Nothing is imported here: building a drafter goes through `drafters.registry.build_proposer`.
"""
