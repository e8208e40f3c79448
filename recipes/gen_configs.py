"""Write `configs/<name>.yaml` from each recipe in this folder, so the YAML files never drift from the recipes.

    python -m recipes.gen_configs            # (re)write every configs/<name>.yaml
    python -m recipes.gen_configs --check    # write nothing; exit 1 naming the files that differ

Each file spells out every field of the recipe's config (not only what differs from the defaults), one blank line
between sections, under a header taken from the recipe's docstring. `tests/test_recipes.py` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from pathlib import Path

import yaml

from megatron_spec.rl.overrides import to_dict

HERE = Path(__file__).resolve().parent


def recipe_names() -> list[str]:
    """The recipe modules beside this file: every public `<name>.py` that defines a function `<name>`."""
    return sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem != "gen_configs")


def render(name: str) -> str:
    """The YAML text of recipe `name`'s config."""
    module = importlib.import_module(f"recipes.{name}")
    cfg = getattr(module, name)()
    summary = " ".join((module.__doc__ or name).strip().split("\n\n")[0].split())
    header = textwrap.wrap(summary, 116) + [
        f"Generated from recipes/{name}.py by `python -m recipes.gen_configs`: edit the recipe, not this file.",
        f"Launch: python recipes/{name}.py [key=value ...]   (a changed copy of this file: add --config FILE)",
    ]
    sections = [yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False)
                for key, value in to_dict(cfg).items()]
    return "".join(f"# {line}\n" for line in header) + "\n" + "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.gen_configs", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="configs", help="folder of the YAML files (default: configs, from the repository "
                   "root)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from its recipe")
    args = p.parse_args(argv)
    out = Path(args.out)
    stale = []
    for name in recipe_names():
        path, text = out / f"{name}.yaml", render(name)
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(str(path))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"differ from their recipes (run `python -m recipes.gen_configs`): {', '.join(stale)}", file=sys.stderr)
        return 1
    for path in [] if args.check else stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
