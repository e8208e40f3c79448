"""Backend names of `RLConfig.backend` -> the classes the loop drives (and the driver of each Ray placement),
imported only when chosen.

Every trainer implements `megatron_spec.interfaces.Policy` and every generator `megatron_spec.interfaces.Generator`
(`tests/test_interfaces.py` checks each entry); both are built by `cls.from_rl(cfg, model, drafter)` from the run's
config and the loaded policy model and drafter. This module names the classes as strings so that the core never
imports Megatron, vLLM or Ray: a missing extra is reported when that backend is chosen, before any compute.
"""

from __future__ import annotations

import importlib

POLICIES = {
    "embedded": ("megatron_spec.trainers.embedded:EmbeddedPolicy", None),
    "megatron": ("megatron_spec.trainers.megatron.policy:MegatronPolicy", "megatron"),
}
GENERATORS = {
    "embedded": ("megatron_spec.generators.embedded:EmbeddedGenerator", None),
    "vllm": ("megatron_spec.generators.vllm:VLLMGenerator", "vllm"),
}
GENERATORS_FROM_FILES = {
    "embedded": ("megatron_spec.generators.process:ProcessGenerator", "megatron"),
    "vllm": ("megatron_spec.generators.process:vllm_from_files", "vllm"),
}
"""`(cfg) -> generator` for a run whose loop holds no policy model (a sharded trainer's): each generator reads the
checkpoint files in processes of its own."""
DRIVERS = {
    "colocated": ("megatron_spec.placement.driver:train", "ray"),
    "disaggregated": ("megatron_spec.placement.driver:train", "ray"),
}
"""`train(cfg)` of each placement other than `inline` (which is `rl.loop.run` in this process)."""


def resolve(table: dict, name: str, what: str):
    """The class (or function) registered under `backend.<what>=name`; an ImportError names the extra to install."""
    if name not in table:
        raise ValueError(f"unknown backend.{what} {name!r}; known: {', '.join(table)}")
    target, extra = table[name]
    module, attr = target.split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as err:
        hint = f" (`pip install 'megatron-spec[{extra}]'`)" if extra else ""
        raise ImportError(f"backend.{what}={name} needs {err.name or 'a missing package'}{hint}: {err}") from err


def build_policy(cfg, model, drafter):
    return resolve(POLICIES, cfg.backend.trainer, "trainer").from_rl(cfg, model, drafter)


def build_generator(cfg, model, drafter):
    """The run's generator on `model` and `drafter`; with `model` None, one that loads them from the files."""
    if model is None:
        return resolve(GENERATORS_FROM_FILES, cfg.backend.generator, "generator")(cfg)
    return resolve(GENERATORS, cfg.backend.generator, "generator").from_rl(cfg, model, drafter)
