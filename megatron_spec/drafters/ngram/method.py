"""The ngram drafter's registry entry: prompt lookup, vLLM's `ngram` method."""

from __future__ import annotations

from ..registry import DrafterMethod, register


def _proposer(spec, target, drafter):
    from .proposer import NgramProposer

    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _prompt_lookup(spec) -> dict:
    return {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}


register(DrafterMethod("ngram", _proposer, vllm_method="ngram", vllm_options=_prompt_lookup, listing=3))
