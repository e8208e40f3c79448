"""HF safetensors -> this rank's Megatron shards.

Every rank reads only the tensors its parameters are made of (safetensors is memory-mapped), builds the full
Megatron tensor (`mapping.to_megatron`) and copies its own slice. Before anything is copied the checkpoint is
checked as a whole: its config against the requested architecture, its tensor names against the names the model
needs (missing shards are reported by `hf_io`), and each slice's shape against the parameter's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from torch import Tensor

from megatron_spec.models.hf_io import name_problems, read_config, weight_files

from . import require_megatron
from .checks import check_config_match
from .mapping import expected_hf_names, global_expert, megatron_to_hf, shard, to_megatron
from .parallel import Ranks, ranks

require_megatron()


class _Checkpoint:
    """Tensors by name, read on demand from a checkpoint directory or taken from a dict."""

    def __init__(self, source: str | os.PathLike | Mapping[str, Tensor]):
        if isinstance(source, Mapping):
            self.files, self.tensors = None, dict(source)
            self.names = set(self.tensors)
        else:
            self.files, self.tensors = weight_files(Path(source)), None
            self.names = set(self.files)
        self._open: dict[Path, object] = {}

    def _file(self, name: str):
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, "pt")
        return self._open[file]

    def get(self, name: str) -> Tensor:
        return self.tensors[name] if self.tensors is not None else self._file(name).get_tensor(name)

    def meta(self, name: str) -> Tensor:
        """A meta tensor of the stored shape: shape checks without reading data."""
        shape = self.tensors[name].shape if self.tensors is not None else self._file(name).get_slice(name).get_shape()
        return torch.empty(tuple(shape), device="meta")


def layer_offset(model) -> int:
    """Global index of this stage's first decoder layer (Megatron's `layer_number` is global and 1-based)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _check_names(ckpt: _Checkpoint, model, where: str) -> None:
    cfg, mtp_layers = model.hf_config, model.config.mtp_num_layers or 0
    expected = expected_hf_names(cfg, mtp_layers)
    missing = sorted(expected - ckpt.names)
    # An HF checkpoint may carry MTP weights the model was built without; anything else unknown is an error.
    # HF checkpoints of tied models sometimes store lm_head.weight as well: it is the embedding, so it is ignored.
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in ckpt.names - expected - ignored if not (n.startswith("mtp.") and not mtp_layers))
    problems = name_problems(missing, unexpected)
    if problems:
        what = f"{cfg.model_type} with {cfg.num_hidden_layers} layers"
        what += f" + {mtp_layers} MTP layer(s)" if mtp_layers else ""
        raise ValueError(f"checkpoint {where} does not hold the tensors of {what}: " + "; ".join(problems))


@torch.no_grad()
def import_hf(model, source: str | os.PathLike | Mapping[str, Tensor], *, check_config: bool = True) -> None:
    """Load an HF checkpoint directory (or a dict of HF-named tensors) into this rank's `model` (from `build_model`).

    Raises ValueError, before copying anything, when the checkpoint's config.json describes another architecture,
    when tensors are missing or unknown, or when a tensor's shape does not fit the parameter it feeds.
    """
    cfg = model.hf_config
    where = str(source) if not isinstance(source, Mapping) else "<tensors>"
    if check_config and not isinstance(source, Mapping):
        check_config_match(read_config(source), cfg, where=f"checkpoint {where}")
    ckpt = _Checkpoint(source)
    _check_names(ckpt, model, where)

    r = ranks()
    offset, tied = layer_offset(model), cfg.tie_word_embeddings
    params = [(p, megatron_to_hf(n, offset, first_stage=r.first_stage, tied=tied), n) for n, p in model.named_parameters()]
    for param, spec, name in params:  # shapes first, on meta tensors: nothing is copied into a model that won't fit
        try:
            shape = tuple(_local_shard(spec, ckpt.meta, cfg, r, model.vocab_size).shape)
        except ValueError as e:
            shape = f"unsplittable ({e})"
        if shape != tuple(param.shape):
            raise ValueError(
                f"checkpoint {where}: {', '.join(_names(spec, cfg, r))} give Megatron parameter {name} the shape "
                f"{shape} on this rank, but the model has {tuple(param.shape)} "
                f"(TP rank {r.tp_rank}/{r.tp}, EP rank {r.ep_rank}/{r.ep}, ETP rank {r.etp_rank}/{r.etp})"
            )
    for param, spec, _ in params:
        param.copy_(_local_shard(spec, ckpt.get, cfg, r, model.vocab_size))


def _names(spec, cfg, r: Ranks) -> tuple[str, ...]:
    g = global_expert(spec.local_expert, r.ep_rank, cfg.num_experts, r.ep) if spec.is_expert else None
    return spec.names(g)


def _local_shard(spec, get, cfg, r: Ranks, padded_vocab: int) -> Tensor:
    hf = tuple(get(n) for n in _names(spec, cfg, r))
    size, rank = (r.etp, r.etp_rank) if spec.is_expert else (r.tp, r.tp_rank)
    full = to_megatron(spec, hf, cfg, size, padded_vocab)
    return shard(spec, full, size, rank)
