"""`megatron-spec stage RECIPE [key=value ...]`: put a recipe's hub checkpoints (policy, drafter, draft model) into
its `model.hub_cache` once, from a login node, so the job's nodes read one shared copy instead of each downloading
its own.

    megatron-spec stage recipes/qwen3_8b_grpo_spec.py model.hub_cache=/lustre/hf

Each hub name is resolved with huggingface_hub into the cache (completed where partly there; taken as it is with
HF_HUB_OFFLINE set); a local directory is only checked to exist. The recipe file is loaded by path, its config is
its function of the same name with `--config` and the overrides laid over it, as the recipe itself resolves them.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def inputs(cfg) -> dict[str, str]:
    """The checkpoints a run reads, by config field: the policy, the drafter, and a draft model's weights."""
    from .models import hub  # imports torch: only when the command runs

    named = {"model.policy": cfg.model.policy, "model.drafter": cfg.model.drafter,
             "spec.model": cfg.spec.model if cfg.spec else None}
    return {field: name for field, name in named.items() if name and name not in hub.BUILTIN}


def stage(cfg) -> dict[str, str]:
    """Every input of `cfg` as a directory on this machine: hub names resolved into `model.hub_cache` (which must
    be set: the default cache is this machine's alone), local directories as they are. Raises FileNotFoundError
    or ValueError naming the input and the fix."""
    from .models import hub

    names = inputs(cfg)
    on_hub = {field: name for field, name in names.items() if hub.is_hub_name(name)}
    if on_hub and not cfg.model.hub_cache:
        raise ValueError(f"{', '.join(on_hub.values())} would go to this machine's default cache, which the job's "
                         "nodes do not read: set model.hub_cache to a directory on a file system every node mounts")
    out = {}
    for field, name in names.items():
        if field in on_hub:
            out[field] = hub.resolve(name, cfg.model.hub_cache)
        elif Path(name).is_dir():
            out[field] = name
        else:
            raise FileNotFoundError(f"{field} {name} is neither a directory on this machine nor a hub name (org/name)")
    return out


def recipe_config(path: str, overrides: list[str], config: str | None = None):
    """The config of the recipe file at `path` (its function named like the file), then `config`, then the
    overrides."""
    from .nemo_run_cli import load_recipe
    from .rl.overrides import apply_overrides, load_yaml

    module = load_recipe(path)
    build = getattr(module, Path(path).stem, None)
    if not callable(build):
        raise ValueError(f"recipe {path} has no function {Path(path).stem}() returning its config")
    cfg = build()
    if config:
        cfg = load_yaml(config, base=cfg)
    return apply_overrides(cfg, overrides)


def run(args: argparse.Namespace) -> int:
    cfg = recipe_config(args.recipe, args.overrides, args.config)
    for field, where in stage(cfg).items():
        name = inputs(cfg)[field]
        print(f"{field} {name}: {where}" if where != name else f"{field} {name}: a local directory, nothing to stage")
    return 0


def register(sub) -> None:
    p = sub.add_parser("stage", help="put a recipe's hub checkpoints into its model.hub_cache once",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="recipe file, e.g. recipes/qwen3_8b_grpo_spec.py")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model.hub_cache=/lustre/hf")
    p.add_argument("--config", help="YAML laid over the recipe's config, before the overrides")
    p.set_defaults(func=run)
