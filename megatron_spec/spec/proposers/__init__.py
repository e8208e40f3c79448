"""Drafters behind one interface, and the factory that builds one from a `SpecConfig`."""

from __future__ import annotations

from ...models.decoder import CausalLM
from ..config import SpecConfig
from .base import Drafts, Proposer
from .draft_model import DraftModelProposer
from .hidden import HiddenStateProposer
from .ngram import HistoryProposer, NgramProposer, SuffixIndex


def build_proposer(spec: SpecConfig, target: CausalLM, drafter=None) -> Proposer:
    """The proposer for `spec.method`, with `drafter` (a module) or the checkpoint at `spec.model`.

    Every mismatch (vocabulary, target architecture, wrong module for the method) is raised here, before any
    generation starts.
    """
    from ...models import MTP, Eagle3Head, check_draft_model, from_pretrained, load_drafter

    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "history":
        return HistoryProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.history_docs_per_prompt)
    if drafter is None:
        if spec.model is None:
            raise ValueError(f"speculative method {spec.method!r} needs a drafter: pass drafter= or set SpecConfig.model")
        if spec.method == "draft_model":
            drafter = from_pretrained(spec.model, dtype=target.dtype, device=target.device)
        else:
            drafter = load_drafter(spec.model, target.config, dtype=target.dtype)
    expected = {"draft_model": CausalLM, "mtp": MTP, "eagle3": Eagle3Head}[spec.method]
    if not isinstance(drafter, expected):
        raise ValueError(f"method {spec.method!r} needs a {expected.__name__} drafter, got {type(drafter).__name__}")
    if spec.method == "draft_model":
        check_draft_model(drafter.config, target.config)
        return DraftModelProposer(drafter.to(target.device), spec.draft_sampling)
    if drafter.target_config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.target_config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size})")
    if drafter.target_config.hidden_size != target.config.hidden_size:
        raise ValueError(f"{spec.method} drafter was built for hidden size {drafter.target_config.hidden_size}, "
                         f"the target has {target.config.hidden_size}")
    return HiddenStateProposer(target, drafter.to(target.device, target.dtype), spec.draft_sampling)


__all__ = ["Drafts", "Proposer", "NgramProposer", "HistoryProposer", "DraftModelProposer", "HiddenStateProposer",
           "SuffixIndex", "build_proposer"]
