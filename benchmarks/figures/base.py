"""What a published figure is: the text a page prints, and where its numbers come from.

A `Figure` is the text a page prints (one or several numbers: '0.996 / 0.992 / 0.993x') and how to read those
numbers from its record; each number must equal the record's at its printed precision. A figure no record holds
names instead the command that computes it, and reads by running that computation. A `Given` is a decimal number
that is not a measurement: a setting, a goal, a bound, a version."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

PAGES = ("docs/results.md", "README.md")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Figure:
    page: str                   # one of PAGES
    printed: str                # exactly as the page prints it
    source: str                 # the record (a path under research/) or the command that computes the figure
    read: Callable[[Any], Any]  # the printed numbers, in order, from the record (None for a computed figure)
    where: str = ""             # text its block must hold, where the page names no record files (the README)
    also: tuple[str, ...] = ()  # further records the read loads (so that they count as checked)


@dataclass(frozen=True)
class Given:
    page: str
    text: str                   # the text on the page holding the number
    why: str                    # what it is: a setting, a goal, a bound, a version


R, README = "docs/results.md", "README.md"


def span(values):
    """A range as printed ('0.27-0.32'): the least and the greatest."""
    values = list(values)
    return [min(values), max(values)]


def load(source: str, root: Path = ROOT) -> Any:
    """A record: JSON, JSON lines (a list of objects) or a log (its text)."""
    text = (root / source).read_text(encoding="utf-8")
    if source.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text) if source.endswith(".json") else text
