"""Every measured figure `docs/results.md` and the README print, tied to the record it comes from, one module a
section of the results page (`benchmarks/claims.py --check` checks them both ways; `base` says what a figure is)."""

from .base import PAGES, Figure, Given
from . import main_job

FIGURES: list[Figure] = [*main_job.FIGURES]
GIVEN: list[Given] = [*main_job.GIVEN]

__all__ = ["FIGURES", "GIVEN", "PAGES", "Figure", "Given"]
