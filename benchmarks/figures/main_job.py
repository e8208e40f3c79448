"""The main job's figures: the results page's first sections and the README's results table."""

from .base import R, README, Figure, Given, span

FIGURES: list[Figure] = []
GIVEN: list[Given] = []
