"""The simulator's CPU validation harness: a model of our eager embedded engine and trainer on this CPU.

It validates the simulator's step model end to end on a machine we can measure (validation (b)), by predicting the
committed `megatron-spec bench step` runs of the tiny model from a measured CPU profile and operator counts of our
code. It is not part of the library: nothing in `megatron_spec` imports it. See README.md here;
`python -m research.sim_cpu --help` for the commands, `python -m pytest research/tests/sim_cpu` for its tests.
"""
