"""Trainers, behind the trainer interface (`megatron_spec.interfaces`): the in-process `embedded` one and Megatron-Core
(`trainers/megatron/`). `rl.backends` names them for `backend.trainer`.
"""
