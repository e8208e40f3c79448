"""Checks before launch: what a submitted job would otherwise find out only once its allocation starts.

A missing extra, a driver module that does not exist, a layout the model cannot take, more GPUs than the allocation
has, a drafter whose vocabulary is not the policy's, chain-length weights the policy's task cannot take: each is one
line of a single error raised on the submitting machine, before anything is rendered or submitted. Needs no optional
dependency (model configs are read as JSON or from the presets; modules are looked up without being imported).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_spec.layout import Layout, layout_problems, world_problems
from megatron_spec.models import ModelConfig
from megatron_spec.models.presets import PRESETS, preset
from megatron_spec.rl.config import RLConfig
from megatron_spec.spec.registry import needs_weights

from .extras import EXTRAS, missing_extras

SCALE_EXTRAS = ("megatron", "vllm", "ray")
"""What the Ray placements need where the job runs: Megatron-Core trains, vLLM generates, Ray places both."""


def policy_config(policy: str) -> ModelConfig | None:
    """The policy's architecture: its `config.json` when it is a local checkpoint, else the preset named like the
    last part of the name (`Qwen/Qwen3-8B` -> `qwen3-8b`); None when neither is known here."""
    path = Path(policy) / "config.json"
    if path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    name = Path(policy).name.lower()
    return preset(name) if name in PRESETS else None


def drafter_vocab(path: str) -> int | None:
    """The vocabulary a drafter checkpoint drafts in (its own config.json, or the target recorded in
    drafter_config.json); None when the checkpoint is not on this machine."""
    for name, keys in (("config.json", ("vocab_size",)), ("drafter_config.json", ("target", "vocab_size"))):
        file = Path(path) / name
        if file.is_file():
            value = json.loads(file.read_text())
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            return value
    return None


def driver_problems(module: str) -> list[str]:
    """The driver module must exist in this version (looked up, not imported: it imports Ray)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return [] if found else [f"the driver module {module} is not in this version of megatron_spec"]


def extras_problems(extras: tuple[str, ...], container_image: str | None) -> list[str]:
    """Without a container the job runs in this Python environment, so what it imports must be installed here; in
    a container it is the image's business (not checkable from here)."""
    if container_image:
        return []
    missing = missing_extras(extras)
    if not missing:
        return []
    modules = ", ".join(EXTRAS[e] for e in missing)
    return [f"the job runs without a container, in this environment, and needs {modules}: "
            f"pip install -e .[{','.join(missing)}] (or pass --container-image)"]


def layout_fit_problems(cfg: RLConfig, layout: dict) -> list[str]:
    """The trainer layout (`Scale.layout`: the split the job will use on the allocation asked for) must fit the
    model and the allocation's GPUs; the engines must fit the allocation."""
    world, meg = layout["gpus"], layout["megatron"]
    lay = Layout(tp=meg["tp"], pp=meg["pp"], ep=meg["ep"], etp=meg["etp"], cp=meg["cp"],
                 first_stage_layers=meg.get("first_stage_layers"), last_stage_layers=meg.get("last_stage_layers"))
    model = policy_config(cfg.model.policy)
    problems = layout_problems(model, lay, who="train") if model is not None else []
    problems += world_problems(world, lay, who="train")
    engines, engine_tp = layout["vllm"]["engines"], layout["vllm"]["tensor_parallel_size"]
    if engines * engine_tp > world:
        problems.append(f"{engines} generation engines x TP {engine_tp} = {engines * engine_tp} GPUs, more than the "
                        f"allocation's {world} (nodes x GPUs per node)")
    return problems


def drafter_problems(cfg: RLConfig) -> list[str]:
    """A drafter with weights must draft in the policy's vocabulary (checked where both are on this machine)."""
    if not cfg.spec or not needs_weights(cfg.spec.method):
        return []
    path = cfg.model.drafter or cfg.spec.model
    model = policy_config(cfg.model.policy)
    vocab = drafter_vocab(path) if path else None
    if model is None or vocab is None or vocab == model.vocab_size:
        return []
    return [f"the drafter {path} drafts in a vocabulary of {vocab} tokens, the policy {cfg.model.policy} has "
            f"{model.vocab_size}"]


def task_problems(cfg: RLConfig) -> list[str]:
    """The task must be one the loop knows, and its chain-length weights must fit the chain lengths the policy was
    pretrained on (checked where the policy checkpoint is on this machine; the chat task needs none)."""
    from megatron_spec.rl.task import task_difficulty

    if cfg.model.task == "tiny" and not Path(cfg.model.policy).is_dir():
        return []
    try:
        task_difficulty(cfg.model.task, cfg.model.policy, cfg.model.terms_weights)
    except ValueError as err:
        return [f"model.task / model.terms_weights: {err}"]
    return []


def check_launch(name: str, cfg: RLConfig, layout: dict | None, *, driver: str | None,
                 extras: tuple[str, ...] = (), container_image: str | None = None) -> None:
    """Raise one ValueError naming every problem found (nothing is submitted then)."""
    problems = driver_problems(driver) if driver else []
    problems += extras_problems(extras, container_image) if extras else []
    problems += layout_fit_problems(cfg, layout) if layout else []
    problems += drafter_problems(cfg)
    problems += task_problems(cfg)
    if problems:
        raise ValueError(f"{name} cannot launch: " + "; ".join(problems))
