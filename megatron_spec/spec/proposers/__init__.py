"""Drafters behind one interface (`spec.registry.build_proposer` picks and builds one from a `SpecConfig`)."""

from __future__ import annotations

from .base import Drafts, Proposer
from .draft_model import DraftModelProposer
from .hidden import HiddenStateProposer
from .ngram import HistoryProposer, NgramProposer, SuffixIndex

__all__ = ["Drafts", "Proposer", "NgramProposer", "HistoryProposer", "DraftModelProposer", "HiddenStateProposer",
           "SuffixIndex"]
