"""The docs stand on their own: every relative link and every cited repository path resolves, and nothing points
outside the repository (a user's clone has nothing beside it: no sibling folder of ours, no notes file)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED = re.compile(r"`((?:megatron_spec|tests|benchmarks|docs|recipes|launchers|slurm|configs|checkpoints|\.ci)/"
                   r"[\w./\-]*\w)`")
# Spelled in pieces so that this file, which must name them, is not itself a hit for `git grep`.
OUTSIDE = ("../" + "shared", "ANCHORS" + ".md", "/work/" + "shared")


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def markdown_files() -> list[Path]:
    return [p for p in tracked("*.md") if p.is_file()]


def broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    bad = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            bad.append(target)
    for cited in CITED.findall(text):
        if any(ch in cited for ch in "*<>{}") or cited.endswith("/..."):
            continue  # a pattern, not a file
        if not (ROOT / cited).exists():
            bad.append(cited)
    return bad


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_cited_path_resolves(path):
    assert not broken_links(path)


def test_nothing_points_outside_the_repository():
    hits = []
    for path in tracked("*"):
        if not path.is_file() or path.suffix in (".png", ".safetensors", ".pt", ".gguf", ".bin"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert not hits


def test_the_checks_catch_a_bad_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](missing.md) [b](https://example.org) `tests/no_such_test.py` `megatron_spec/rl/loop.py`")
    assert broken_links(doc) == ["missing.md", "tests/no_such_test.py"]
