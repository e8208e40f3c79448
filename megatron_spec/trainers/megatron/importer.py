"""HF safetensors -> this rank's Megatron shards.

Every rank reads only what its parameters are made of: from a checkpoint directory (or several: the policy's and
an MTP drafter's), the slices of the tensors it owns, by name, from the memory-mapped safetensors files
(`safe_open(...).get_slice`), so no rank ever holds a full tensor it only has a part of, let alone the full model.
From a dict of in-memory HF tensors, each full Megatron tensor (`mapping.to_megatron`) is built and cut
(`mapping.shard`); both give the same shards bit for bit. Before anything is copied the checkpoint is checked as a
whole: its config against the requested architecture, its tensor names against the names the model needs (missing
shards are reported by `hf_io`), and each slice's shape against the parameter's.
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
from .mapping import (
    COLUMN, FC1, QKV, REPLICATED, ROW, VOCAB, expected_hf_names, global_expert, megatron_to_hf, merge_qkv, shard,
    to_megatron,
)
from .parallel import Ranks, ranks

require_megatron()


Source = str | os.PathLike | Mapping[str, Tensor] | list | tuple
"""A checkpoint directory, several (policy + drafter: their names are merged), or a dict of HF-named tensors."""


class _Checkpoint:
    """Tensors by name, read on demand from checkpoint directories or taken from a dict."""

    def __init__(self, source: Source):
        if isinstance(source, Mapping):
            self.files, self.tensors = None, dict(source)
            self.names = set(self.tensors)
        else:
            dirs = [source] if isinstance(source, (str, os.PathLike)) else list(source)
            self.files, self.tensors = {}, None
            for d in dirs:
                files = weight_files(Path(d))
                clash = sorted(set(files) & set(self.files))
                if clash:
                    raise ValueError(f"checkpoint {d} repeats tensors of an earlier directory, e.g. {clash[:3]}")
                self.files.update(files)
            self.names = set(self.files)
        self._open: dict[Path, object] = {}

    @property
    def in_memory(self) -> bool:
        return self.tensors is not None

    def slice(self, name: str):
        """Something indexable like the tensor (`[a:b]`, `[:, a:b]`) that reads only the indexed part."""
        return self.tensors[name] if self.tensors is not None else self._file(name).get_slice(name)

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


def chunks_of(model) -> list:
    """A model, or the list of a rank's virtual-pipeline chunks, as a list of chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


@torch.no_grad()
def import_hf(model, source: Source, *, check_config: bool = True) -> None:
    """Load an HF checkpoint directory (a list: the policy's, then a drafter's; or a dict of HF-named tensors) into
    this rank's `model` (from `build_model`; a list of its virtual-pipeline chunks: each in turn), reading from files
    only the slices this rank owns.

    Raises ValueError, before copying anything, when the checkpoint's config.json describes another architecture,
    when tensors are missing or unknown, or when a tensor's shape does not fit the parameter it feeds.
    """
    if isinstance(model, (list, tuple)):
        for chunk in model:
            import_hf(chunk, source, check_config=check_config)
        return
    cfg = model.hf_config
    where = "<tensors>" if isinstance(source, Mapping) else (
        str(source) if isinstance(source, (str, os.PathLike)) else " + ".join(map(str, source)))
    if check_config and not isinstance(source, Mapping):
        first = source if isinstance(source, (str, os.PathLike)) else source[0]
        check_config_match(read_config(first), cfg, where=f"checkpoint {first}")
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
        if ckpt.in_memory:
            param.copy_(_local_shard(spec, ckpt.get, cfg, r, model.vocab_size))
        else:
            param.copy_(_read_shard(spec, ckpt, cfg, r, model.vocab_size))
    ckpt._open.clear()  # close the memory maps


def _names(spec, cfg, r: Ranks) -> tuple[str, ...]:
    g = global_expert(spec.local_expert, r.ep_rank, cfg.num_experts, r.ep) if spec.is_expert else None
    return spec.names(g)


def _local_shard(spec, get, cfg, r: Ranks, padded_vocab: int) -> Tensor:
    hf = tuple(get(n) for n in _names(spec, cfg, r))
    size, rank = (r.etp, r.etp_rank) if spec.is_expert else (r.tp, r.tp_rank)
    full = to_megatron(spec, hf, cfg, size, padded_vocab)
    return shard(spec, full, size, rank)


def _rows(n: int, size: int, rank: int) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"cannot split {n} rows into {size} equal parts")
    return rank * n // size, (rank + 1) * n // size


def _read_shard(spec, ckpt: _Checkpoint, cfg, r: Ranks, padded_vocab: int) -> Tensor:
    """This rank's shard read slice by slice from the files: equal to `_local_shard` on the full tensors (the same
    rows and columns, in the same order), without reading the other ranks' parts."""
    names = _names(spec, cfg, r)
    size, rank = (r.etp, r.etp_rank) if spec.is_expert else (r.tp, r.tp_rank)
    slices = [ckpt.slice(n) for n in names]
    if spec.kind == REPLICATED or size == 1 and spec.kind != VOCAB:
        if spec.kind in (QKV, FC1):
            return to_megatron(spec, tuple(s[:] for s in slices), cfg, size, padded_vocab)
        return slices[0][:]
    if spec.kind in (COLUMN, ROW):
        a, b = _rows(_shape(slices[0])[SPLIT[spec.kind]], size, rank)
        return slices[0][a:b] if spec.kind == COLUMN else slices[0][:, a:b]
    if spec.kind == VOCAB:  # this rank's rows of the zero-padded table: the stored rows among them, then zeros
        a, b = _rows(padded_vocab, size, rank)
        stored = _shape(slices[0])[0]
        part = slices[0][min(a, stored) : min(b, stored)]
        if part.shape[0] < b - a:
            part = torch.cat([part, part.new_zeros(b - a - part.shape[0], *part.shape[1:])])
        return part
    if spec.kind == QKV:  # whole query groups per rank: each of q, k, v cut at group boundaries
        parts = []
        for s in slices:
            a, b = _rows(_shape(s)[0], size, rank)
            parts.append(s[a:b])
        return merge_qkv(*parts, cfg.num_key_value_heads // size)
    if spec.kind == FC1:  # [gate chunk r; up chunk r]
        parts = []
        for s in slices:
            a, b = _rows(_shape(s)[0], size, rank)
            parts.append(s[a:b])
        return torch.cat(parts)
    raise ValueError(f"unknown parameter kind {spec.kind!r}")


SPLIT = {COLUMN: 0, ROW: 1}


def _shape(s) -> tuple[int, ...]:
    return tuple(s.get_shape()) if hasattr(s, "get_shape") else tuple(s.shape)
