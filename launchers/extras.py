"""Optional dependencies, by the name of the pip extra that installs them (see pyproject.toml)."""

from __future__ import annotations

import importlib.util

EXTRAS = {
    "nemo": "nemo_run",
    "megatron": "megatron.core",
    "vllm": "vllm",
    "ray": "ray",
}
"""pip extra -> the module it provides."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def _installed(module: str) -> bool:
    # find_spec answers without importing the module (vLLM or Ray take seconds to import). A dotted name makes
    # it import the parent package, which raises when the parent itself is missing; a module placed in sys.modules
    # without a spec raises ValueError.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extras(extras: tuple[str, ...] | list[str]) -> list[str]:
    """The extras among `extras` whose module cannot be found."""
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extra(s) {unknown}: known are {', '.join(EXTRAS)}")
    return [e for e in extras if not _installed(EXTRAS[e])]


def require_extras(extras: tuple[str, ...] | list[str], why: str) -> None:
    """Raise MissingExtra naming every missing extra and the one pip command that installs them all."""
    missing = missing_extras(extras)
    if missing:
        modules = ", ".join(EXTRAS[e] for e in missing)
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtra(f"{why} needs {modules}, which {verb} not installed: pip install -e .[{','.join(missing)}]")
