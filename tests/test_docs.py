"""The docs stand on their own and say only what holds now.

- Every relative link and every cited repository path in a tracked Markdown file resolves, and nothing points
  outside the repository (a user's clone has nothing beside it: no sibling folder of ours, no notes file).
- The README is a front door (at most 150 lines and 1,200 words, no record file names or commit hashes, no "this
  CPU"); `docs/results.md`, the one page of current numbers, is at most 250 lines.
- The product and its user-facing pages (`megatron_spec/`, `docs/guide/`, `docs/results.md`, the README) carry no
  figures from unrecorded ("scratch") runs, no issue numbers, no dates and no words about when or in which round of
  work something was done, and no paths into the old record folder: histories belong in `docs/design/` and
  `research/notebook/`, record paths in `docs/results.md` (under `research/`).
- `research/` stays apart: not imported by `megatron_spec/` or `tests/`, not packaged.

Each rule is a function returning its problems, so `test_each_rule_catches_a_planted_violation` can run it on a
planted tree."""

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED = re.compile(r"`((?:megatron_spec|tests|benchmarks|research|docs|recipes|launchers|slurm|configs|checkpoints|"
                   r"\.ci)/[\w./\-]*\w)`")
# Spelled in pieces so that this file, which must name them, is not itself a hit for `git grep`.
OUTSIDE = ("../" + "shared", "ANCHORS" + ".md", "/work/" + "shared")
OLD_RECORDS = "benchmarks/" + "results"

# A figure's source must be a record: "scratch" as a source ("(scratch)", "scratch timing", "in scratch runs") is
# refused; "from scratch" and a scratch buffer are other words.
WORDING = {
    "unrecorded figure": re.compile(r"\(scratch|scratch\)|\bscratch (timing|runs?|scripts?|measurements?|figures?|"
                                    r"checks?|tests?)\b|\bin scratch\b|[;,] scratch\b", re.I),
    "issue number": re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.I),
    "date": re.compile(r"\b20[2-3]\d-[01]\d(-[0-3]\d)?\b"),
    "when the work was done": re.compile(
        r"\b(this|that|the same|an? earlier|earlier|later|last|next|previous|another|one) sessions?\b|"
        r"\bsessions ago\b|\bstop \d+\b|\b(this|earlier|later|last|next|previous) round of work\b|"
        r"\b(today|yesterday)\b", re.I),
    "old record path": re.compile(re.escape(OLD_RECORDS)),
}
FRONT_DOOR = {
    "record file name": re.compile(r"\b[\w\-]+\.(?:json|jsonl|log)\b"),
    "commit hash": re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "unnamed machine": re.compile(r"\bthis (CPU|GPU|machine|host)\b|\bhere\b", re.I),
}
RESEARCH_IMPORT = re.compile(r"^\s*(?:from|import)\s+research\b", re.M)
BINARY = (".png", ".safetensors", ".pt", ".gguf", ".bin", ".so", ".jsonl")


def tracked(pattern: str, root: Path = ROOT) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=root, capture_output=True, text=True, check=True).stdout
    return [root / p for p in out.split()]


def markdown_files() -> list[Path]:
    return [p for p in tracked("*.md") if p.is_file()]


def text_of(path: Path) -> str | None:
    if path.suffix in BINARY or not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
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
        if not (root / cited).exists():
            bad.append(cited)
    return bad


def wording_problems(paths: list[Path], rules: dict = WORDING) -> list[str]:
    """`file:line: rule: text` for every line of `paths` that breaks one of `rules`."""
    hits = []
    for path in paths:
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for rule, pattern in rules.items():
                match = pattern.search(line)
                if match:
                    hits.append(f"{path}:{number}: {rule}: {match.group(0)!r}")
    return hits


def size_problems(path: Path, max_lines: int, max_words: int | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines, words = len(text.splitlines()), len(text.split())
    problems = [f"{path.name}: {lines} lines > {max_lines}"] if lines > max_lines else []
    if max_words is not None and words > max_words:
        problems.append(f"{path.name}: {words} words > {max_words}")
    return problems


def research_imports(paths: list[Path]) -> list[str]:
    return [str(p) for p in paths if p.suffix == ".py" and RESEARCH_IMPORT.search(p.read_text(encoding="utf-8"))]


def scope(name: str, root: Path = ROOT) -> list[Path]:
    """The tracked files a wording rule covers: a folder's whole tree, or one file."""
    return tracked(name, root) if (root / name).is_dir() else [root / name]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_cited_path_resolves(path):
    assert not broken_links(path)


def test_nothing_points_outside_the_repository():
    hits = []
    for path in tracked("*"):
        text = text_of(path)
        if text is not None:
            hits += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert not hits


WORDING_SCOPES = ["megatron_spec", "docs/guide", "docs/results.md", "README.md"]


@pytest.mark.parametrize("name", WORDING_SCOPES)
def test_wording(name):
    assert not wording_problems(scope(name))


def test_readme_is_a_front_door():
    readme = ROOT / "README.md"
    assert not size_problems(readme, max_lines=150, max_words=1200)
    assert not wording_problems([readme], FRONT_DOOR)


def test_results_page_is_short():
    assert not size_problems(ROOT / "docs/results.md", max_lines=250)


def test_research_stays_apart():
    assert not research_imports(tracked("megatron_spec") + tracked("tests"))
    with open(ROOT / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    packaged = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert packaged and not [p for p in packaged if p.startswith(("research", "*"))]  # research/ is never installed
    assert pyproject["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]  # nor collected by the default suite


def test_the_checks_catch_a_bad_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](missing.md) [b](https://example.org) `tests/no_such_test.py` `megatron_spec/rl/loop.py`")
    assert broken_links(doc) == ["missing.md", "tests/no_such_test.py"]


@pytest.mark.parametrize("line, rule", [
    ("k = 3 gained 1.04x (scratch).", "unrecorded figure"),
    ("measured in scratch runs, not kept", "unrecorded figure"),
    ("as asked in issue 19, the margin", "issue number"),
    ("the verifier (issue #7) is", "issue number"),
    ("measured on 2026-11-27 on the host", "date"),
    ("An earlier session measured it", "when the work was done"),
    ("as of this session the kernel", "when the work was done"),
    ("after stop 4 the controller", "when the work was done"),
    ("see `benchmarks/" + "results/main_job.json`", "old record path"),
])
def test_each_rule_catches_a_planted_violation(tmp_path, line, rule):
    """A guide page in a planted tree with one violating line: the scoped check finds exactly that rule there, and
    the same page without the line is clean."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    page = tmp_path / "docs" / "guide" / "page.md"
    page.parent.mkdir(parents=True)
    page.write_text(f"# A page\n\nTrains a model from scratch into a scratch buffer.\n{line}\n")
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    problems = wording_problems(scope("docs/guide", tmp_path))
    assert [p.split(": ")[1] for p in problems] == [rule] and problems[0].startswith(f"{page}:4:")
    page.write_text("# A page\n\nTrains a model from scratch into a scratch buffer.\n")
    assert not wording_problems(scope("docs/guide", tmp_path))


def test_front_door_and_size_rules_catch_planted_violations(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nOn this CPU the gen stage ran 1.07x (main_job_7535669.json, commit 7535669).\n")
    rules = sorted(p.split(": ")[1] for p in wording_problems([readme], FRONT_DOOR))
    assert rules == ["commit hash", "record file name", "unnamed machine"]
    readme.write_text("word " * 1201 + "\n" * 151)
    assert size_problems(readme, max_lines=150, max_words=1200) == ["README.md: 151 lines > 150",
                                                                     "README.md: 1201 words > 1200"]
    readme.write_text("# x\n\nOn a 2-core AVX2 EPYC CPU the gen stage ran 1.07x ([results](docs/results.md)).\n")
    assert not wording_problems([readme], FRONT_DOOR) and not size_problems(readme, 150, 1200)


def test_research_import_rule_catches_a_planted_import(tmp_path):
    bad, good = tmp_path / "test_bad.py", tmp_path / "test_good.py"
    bad.write_text("import os\nfrom research.sim_cpu import counts\n")
    good.write_text('"""Mentions research.sim_cpu in prose only."""\nimport os\n')
    assert research_imports([bad, good]) == [str(bad)]
