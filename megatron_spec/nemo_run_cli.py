"""`nemo-run`: run a recipe file the way NeMo-Run users launch recipes.

    nemo-run recipes/tiny_grpo_spec.py key=value ... [--config YAML] [--dryrun] [--executor local|slurm|ray-slurm]
    nemo-run recipes/qwen3_235b_grpo_spec.py --tune --nodes 16 --gpus-per-node 8 --dryrun

The `nemo_run` package installs the `nemo` and `nemorun` commands but no `nemo-run`; this one loads the recipe
file by path and hands it the rest of the command line (`main(argv)`), so it behaves exactly like
`python recipes/<name>.py ...`: `--executor slurm` builds a `run.Script` of the recipe's command and runs it on
NeMo-Run's `SlurmExecutor`, `ray-slurm` submits `slurm/ray.sub` through NeMo-Run's tunnel (`launchers/`). It
imports no optional dependency itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

USAGE = ("usage: nemo-run RECIPE.py [key=value ...] [--config YAML] [--dryrun] [--executor local|slurm|ray-slurm] "
         "[--tune] [--help]")


def load_recipe(path: str | Path) -> ModuleType:
    """Import a recipe file from its location (it need not be on sys.path nor in a package)."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(f"recipe {path} is not a Python file (e.g. recipes/tiny_grpo_spec.py)")
    # A name of its own, so that loading recipes/x.py never replaces an imported module called `x`.
    name = f"_nemo_run_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    if not callable(getattr(module, "main", None)):
        raise ValueError(f"recipe {path} has no main(argv) function")
    return module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip().splitlines()[0]}", file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    try:
        recipe = load_recipe(argv[0])
    except (FileNotFoundError, ValueError) as err:
        print(f"nemo-run: error: {err}", file=sys.stderr)
        return 2
    return int(recipe.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
