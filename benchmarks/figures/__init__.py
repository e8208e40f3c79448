"""Every measured figure `docs/results.md` and the README print, tied to the record it comes from, one module a
section of the results page (`benchmarks/claims.py --check` checks them both ways; `base` says what a figure is)."""

from .base import PAGES, Figure, Given
from . import main_job
from . import at_scale, audit, data, engine, gpu
from . import simulator

FIGURES: list[Figure] = [*main_job.FIGURES, *engine.FIGURES, *gpu.FIGURES, *at_scale.FIGURES, *audit.FIGURES, *data.FIGURES,
                         *simulator.FIGURES]
GIVEN: list[Given] = [*main_job.GIVEN, *engine.GIVEN, *gpu.GIVEN, *at_scale.GIVEN, *audit.GIVEN, *data.GIVEN,
                      *simulator.GIVEN]

__all__ = ["FIGURES", "GIVEN", "PAGES", "Figure", "Given"]
