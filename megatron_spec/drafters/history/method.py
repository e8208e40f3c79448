"""The history drafter's registry entry: lookup in the earlier rollouts of the same prompt; in vLLM, its suffix
decoding (Arctic Inference). Like prompt lookup it drafts on the host: the simulator gives it no draft forward."""

from __future__ import annotations

from ..registry import DrafterMethod, register


def _proposer(spec, target, drafter):
    from .proposer import HistoryProposer

    return HistoryProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.history_docs_per_prompt)


def _suffix(spec) -> dict:
    """vLLM's suffix decoding drafts from a tree of the request's prompt and of earlier requests' completions (the
    rollouts of one prompt repeat each other, across a step's group and across steps): its trees deep enough for
    the longest n-gram matched plus the drafts."""
    return {"suffix_decoding_max_tree_depth": spec.prompt_lookup_max + spec.num_speculative_tokens}


register(DrafterMethod("history", _proposer, vllm_method="suffix", vllm_options=_suffix,
                       vllm_needs=("arctic_inference", "suffix"), listing=4))
