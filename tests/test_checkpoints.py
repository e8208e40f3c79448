"""The shipped checkpoints: together under 40 MB (a clone stays small), and each one used by a test, a recipe, a
config or a benchmark (a checkpoint nothing loads is weight in every clone for nothing)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 40_000_000
USERS = ("tests", "recipes", "configs", "benchmarks")


def tracked(*paths: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def unused(names: set[str], texts: list[str]) -> set[str]:
    """The checkpoint names no text mentions as a whole name (`tiny-qwen3` is not used by `tiny-qwen3-mtp`)."""
    return {n for n in names if not any(re.search(rf"{re.escape(n)}(?![\w-])", t) for t in texts)}


def test_shipped_checkpoints_are_small_and_used():
    files = tracked("checkpoints")
    assert sum(f.stat().st_size for f in files) < LIMIT_BYTES
    names = {f.relative_to(ROOT / "checkpoints").parts[0] for f in files if f.parent != ROOT / "checkpoints"}
    texts = [p.read_text(errors="ignore") for p in tracked(*USERS) if p.suffix in (".py", ".yaml", ".sh", ".md")]
    assert not unused(names, texts)


def test_the_usage_check_tells_a_prefix_from_a_name():
    texts = ['load("checkpoints/tiny-qwen3-mtp")', "checkpoints/tiny-qwen3-deep\n"]
    assert unused({"tiny-qwen3", "tiny-qwen3-mtp", "tiny-qwen3-deep", "tiny-draft"}, texts) == {"tiny-qwen3",
                                                                                                   "tiny-draft"}
