"""Save and load drafters with weights (MTP, EAGLE-3) next to, not inside, their target's checkpoint.

A drafter directory holds `drafter_config.json` and `model.safetensors`:

    {"kind": <method name>, "config": {...the drafter's own dataclass...}, "target": {...fingerprint...}}

An EAGLE-3 head with a draft vocabulary (`draft_vocab_size` > 0) also saves its `d2t` buffer (draft id -> target id,
int64) in `model.safetensors`: the map belongs to the weights (row i of its `lm_head` means target id d2t[i]), so
it travels with them and is validated on save and on load (length, range, no duplicates).

The fingerprint records the target architecture the weights were made for. Loading checks it against the target
at hand and raises one ValueError naming every mismatch before a single tensor is read, because a drafter for
another architecture either fails on shapes deep inside load_state_dict or, worse, loads and drafts garbage.

A draft model drafter is an ordinary `CausalLM` (`hf_io.from_pretrained`); `check_draft_model` is its guard.

`export_trained_drafter` writes a drafter trained elsewhere (online, in a run) back in the layout its starting
checkpoint has: ours, a public EAGLE-3 layout (`eagle3_public`), or an HF model directory for a draft model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..models.config import ModelConfig
from .eagle3.model import check_d2t
from ..models.hf_io import check_state, load_tensors, save_tensors, write_atomically
from .registry import saved_kinds

DRAFTER_CONFIG = "drafter_config.json"


def head_classes(kind: str) -> tuple[type, type, str]:
    """(module class, its config dataclass, the attribute holding that config) of a head saved as `kind`."""
    method = saved_kinds()[kind]
    return (method.module(), *method.saved_config())

FINGERPRINT_FIELDS = (
    "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim",
)


def target_fingerprint(cfg: ModelConfig) -> dict:
    """The target-architecture fields a drafter's weights depend on."""
    return {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}


def _check_fingerprint(saved: dict, target_config: ModelConfig, where: str) -> None:
    want = target_fingerprint(target_config)
    bad = [k for k, v in want.items() if saved.get(k) != v]
    if not bad:
        return
    what = "vocabulary" if bad == ["vocab_size"] else "architecture"
    diffs = "; ".join(f"{k}: drafter {saved.get(k)!r} vs target {want[k]!r}" for k in bad)
    raise ValueError(f"drafter {where} was made for another target {what}: {diffs}")


def save_drafter(module: nn.Module, out_dir: str | os.PathLike, kind: str, target_config: ModelConfig) -> Path:
    """Write `module` (an `MTP` or `Eagle3Head` built for `target_config`) to `out_dir`, atomically."""
    if kind not in saved_kinds():
        raise ValueError(f"unknown drafter kind {kind!r}: expected one of {', '.join(saved_kinds())} (a drafter "
                         "that is a CausalLM saves with save_pretrained)")
    cls, _, attr = head_classes(kind)
    if not isinstance(module, cls):
        raise ValueError(f"drafter kind {kind!r} needs a {cls.__name__}, got {type(module).__name__}")
    _check_fingerprint(target_fingerprint(module.target_config), target_config, f"being saved to {out_dir}")
    if getattr(module, "d2t", None) is not None:
        check_d2t(module.d2t, module.eagle_config.draft_vocab_size, target_config.vocab_size,
                  f"d2t of the drafter being saved to {out_dir}")
    meta = {
        "kind": kind,
        "config": dataclasses.asdict(getattr(module, attr)),
        "target": target_fingerprint(target_config),
    }
    tensors = dict(module.state_dict())

    def write(tmp: Path) -> None:
        (tmp / DRAFTER_CONFIG).write_text(json.dumps(meta, indent=2))
        save_tensors(tensors, tmp)

    return write_atomically(out_dir, write)


def read_drafter_config(path: str | os.PathLike) -> dict:
    cfg_file = Path(path) / DRAFTER_CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no {DRAFTER_CONFIG} in drafter directory {path}")
    return json.loads(cfg_file.read_text())


def drafter_kind_and_config(path: str | os.PathLike, target_config: ModelConfig) -> tuple[str, object]:
    """The kind and resolved config of the drafter saved in `path` (our layout), its config checked against
    `target_config` (kind known, target fingerprint) before any tensor is read."""
    meta = read_drafter_config(path)
    kind = meta.get("kind")
    if kind not in saved_kinds():
        raise ValueError(f"{Path(path) / DRAFTER_CONFIG}: unknown drafter kind {kind!r}, expected one of "
                         f"{', '.join(saved_kinds())}")
    _check_fingerprint(meta.get("target", {}), target_config, str(path))
    return kind, head_classes(kind)[1](**meta.get("config", {}))


def load_drafter(
    path: str | os.PathLike,
    target_config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The drafter saved in `path`, checked against `target_config` before any tensor is read, in eval mode. A public
    EAGLE-3 head (vLLM speculators or SpecForge layout, no drafter_config.json) loads through `eagle3_public`."""
    from .eagle3.public import load_public_eagle3, public_layout

    if not (Path(path) / DRAFTER_CONFIG).is_file() and public_layout(path) is not None:
        return load_public_eagle3(path, target_config, dtype, device)
    kind, drafter_cfg = drafter_kind_and_config(path, target_config)
    cls = head_classes(kind)[0]
    with torch.device("meta"):
        module = cls(target_config, drafter_cfg)
    tensors = load_tensors(path, dtype)
    draft_vocab = getattr(drafter_cfg, "draft_vocab_size", 0)
    if draft_vocab and "d2t" in tensors:  # a missing map is reported by check_state with the other names
        check_d2t(tensors["d2t"], draft_vocab, target_config.vocab_size, f"{path}: d2t")
    check_state(module, tensors, str(path))
    module.load_state_dict(tensors, strict=True, assign=True)
    return module.to(device=device, dtype=dtype).eval()


def check_draft_model(draft_cfg: ModelConfig, target_cfg: ModelConfig) -> None:
    """Raise unless a separate draft model proposes tokens in the target's vocabulary (same ids, same size)."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_cfg.vocab_size} tokens) differs from the target's "
            f"({target_cfg.vocab_size}): speculative decoding needs one shared tokenizer"
        )


def export_trained_drafter(source: str | os.PathLike, tensors: dict[str, torch.Tensor], target_config: ModelConfig,
                           out_dir: str | os.PathLike) -> Path:
    """The drafter checkpoint `source` with its weights replaced by `tensors` (the state dict of a trained copy),
    written to `out_dir` in `source`'s layout: a public EAGLE-3 head as `save_public_eagle3` writes it (its
    config, its names and dtypes, the tensors it keeps that our head does not), ours with its drafter_config.json,
    a draft model as an HF checkpoint. Names or shapes that do not match `source` raise before anything is
    written."""
    from ..models.decoder import CausalLM
    from .eagle3.public import public_layout, save_public_eagle3
    from ..models.hf_io import from_pretrained, save_pretrained

    source = Path(source)
    weighted = (source / DRAFTER_CONFIG).is_file() or public_layout(source) is not None
    module = load_drafter(source, target_config) if weighted else from_pretrained(source)
    expected = module.state_dict()
    if set(tensors) != set(expected) or any(tensors[k].shape != expected[k].shape for k in expected):
        diff = sorted(set(tensors) ^ set(expected))[:5]
        raise ValueError(f"the trained drafter's tensors do not match {source} (names differing: {diff})")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=True)
    if getattr(module, "public", None) is not None:
        return save_public_eagle3(module, out_dir)
    if isinstance(module, CausalLM):
        return save_pretrained(module, out_dir)
    return save_drafter(module, out_dir, read_drafter_config(source)["kind"], target_config)


def load_head(path, target, device) -> nn.Module:
    """A head saved in our layout (or a public EAGLE-3 one) for `target`, in its dtype: a registry entry's `load`."""
    return load_drafter(path, target.config, dtype=target.dtype, device=device)
