"""Generators, behind the generator interface (`megatron_spec.interfaces`): the in-process engine (`embedded`), the
engine in its own process (`process`) and vLLM (`generators/vllm/`). `rl.backends` names them for `backend.generator`.
"""
