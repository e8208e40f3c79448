"""`megatron-spec export-hf RUN_DIR/checkpoints/step_N OUT`: a Megatron trainer's distributed checkpoint (its
`policy/` directory, Megatron-Core `torch_dist`) -> an HF checkpoint of the policy (`OUT`) and of its MTP layers
as our MTP drafter (`OUT/drafter`), streamed.

The checkpoint's tensors are layout-independent (the full Megatron tensor of each parameter, whatever TP / PP / EP
wrote it): each one is read alone from the per-rank files (`torch.distributed.checkpoint`, no process group),
turned into its HF tensors (`mapping.from_megatron`: QKV split, gate / up split, vocabulary padding trimmed,
stacked experts split by expert) and added to the current safetensors shard, which is written out once it holds
`max_shard_bytes`. So at most one Megatron tensor (one layer's stacked experts) and one shard are in memory.
The weights are the fp32 masters; `dtype` converts them as they are written.

Needs torch only (not megatron-core): the mapping is pure.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from megatron_spec.models.config import ModelConfig
from megatron_spec.models.hf_io import INDEX_FILE, read_config, write_atomically

from .mapping import from_megatron, megatron_to_hf

PREFIX = "weights."
DEFAULT_SHARD_BYTES = 2 * 2**30
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.experts\.(linear_fc1|linear_fc2)\.weight$")


def _reader(policy_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(policy_dir))


def _load(reader, key: str, meta) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    dcp.load({key: t}, storage_reader=reader, no_dist=True)
    return t


def _order(name: str) -> tuple:
    """Embedding, decoder layers by number, final norm, output layer, then MTP layers: HF's usual order."""
    m = re.match(r"^(decoder\.layers|mtp\.layers)\.(\d+)\.", name)
    if name.startswith("embedding."):
        return (0, 0, name)
    if m:
        return (1 if m[1] == "decoder.layers" else 4, int(m[2]), name)
    return (2 if name.startswith("decoder.") else 3, 0, name)


def hf_tensors(policy_dir: str | os.PathLike, cfg: ModelConfig):
    """(hf_name, tensor) of every weight in a distributed checkpoint's `policy/` directory, one Megatron tensor at
    a time."""
    reader = _reader(Path(policy_dir))
    metadata = reader.read_metadata().state_dict_metadata
    names = sorted((k[len(PREFIX):] for k, v in metadata.items()
                    if k.startswith(PREFIX) and "_extra_state" not in k and hasattr(v, "size")), key=_order)
    if not names:
        raise ValueError(f"{policy_dir} holds no policy weights (no '{PREFIX}*' tensors): not a Megatron trainer's "
                         "distributed checkpoint")
    for name in names:
        full = _load(reader, PREFIX + name, metadata[PREFIX + name])
        stacked = _STACKED.match(name)
        parts = ([(f"{stacked[1]}.local_experts.{e}.{stacked[2]}.weight", full[e]) for e in range(full.shape[0])]
                 if stacked else [(name, full)])
        for mname, tensor in parts:
            spec = megatron_to_hf(mname, 0, first_stage=True, tied=cfg.tie_word_embeddings)
            if not spec.export:
                continue
            hf_names = spec.names(spec.local_expert) if spec.is_expert else spec.hf_names
            for hf_name, t in zip(hf_names, from_megatron(spec, tensor, cfg, 1)):
                yield hf_name, t


def _write_shards(items, out: Path, max_shard_bytes: int, prefix: str = "model") -> int:
    """Write (name, tensor) items into safetensors shards of at most `max_shard_bytes` as they come, then the
    HF index; returns the tensors written."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    size, files, weight_map, total, count = 0, [], {}, 0, 0

    def flush():
        nonlocal shard, size
        if shard:
            fname = f"{prefix}-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({n: fname for n in shard})
        shard, size = {}, 0

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = t.contiguous().clone()
        size += nbytes
        total += nbytes
        count += 1
    flush()
    renamed = {f: f"{prefix}-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": {n: renamed[f] for n, f in weight_map.items()}}, indent=2))
    return count


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, policy: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `out_dir` (config.json + safetensors shards + index; MTP layers, if any, as the drafter directory
    `out_dir/drafter`) from the run checkpoint `ckpt_dir`, atomically. `policy`: the HF checkpoint whose
    config.json describes the model (default: the run's `model.policy`, from the checkpoint's saved config)."""
    from megatron_spec.drafters.files import DRAFTER_CONFIG, target_fingerprint
    from megatron_spec.drafters.mtp.model import MTPConfig
    from megatron_spec.drafters.registry import layers_method

    ckpt_dir = Path(ckpt_dir)
    state_file, policy_dir = ckpt_dir / "state.pt", ckpt_dir / "policy"
    if not state_file.is_file() or not policy_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron trainer's run checkpoint (needs state.pt and policy/; "
                                "pass RUN_DIR/checkpoints/step_N)")
    saved = torch.load(state_file, map_location="cpu", weights_only=False)
    source = policy or saved.get("config", {}).get("model.policy")
    if not source or not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"the model's config.json is not at {source!r}: pass --policy DIR (the HF checkpoint "
                                "the run started from)")
    cfg = read_config(source)
    config_json = json.loads((Path(source) / "config.json").read_text())
    drafter_src = saved.get("config", {}).get("model.drafter") or saved.get("config", {}).get("spec.model")

    def convert(items):
        for n, t in items:
            yield n, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)

    def write(tmp: Path) -> None:
        mtp: list[tuple[str, torch.Tensor]] = []

        def policy_items():
            for n, t in convert(hf_tensors(policy_dir, cfg)):
                if n.startswith("mtp."):
                    mtp.append((n, t.contiguous().clone()))  # the MTP layers come last and are small
                else:
                    yield n, t

        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        _write_shards(policy_items(), tmp, max_shard_bytes)
        if mtp:
            drafter = tmp / "drafter"
            drafter.mkdir()
            layers = len({n.split(".")[2] for n, _ in mtp})
            conf = {"num_layers": layers}
            if drafter_src and (Path(drafter_src) / DRAFTER_CONFIG).is_file():
                conf = json.loads((Path(drafter_src) / DRAFTER_CONFIG).read_text()).get("config", conf)
            meta = {"kind": layers_method().name, "config": {**MTPConfig(**conf).__dict__}, "target": target_fingerprint(cfg)}
            (drafter / DRAFTER_CONFIG).write_text(json.dumps(meta, indent=2))
            _write_shards(iter(mtp), drafter, max_shard_bytes)

    return write_atomically(out_dir, write)
