"""The MTP drafter in the layout vLLM loads: our tensors unchanged, with a `config.json` that is the target's with
`model_type: "mtp"`, `architectures: ["MegatronSpecMTP"]` (our plugin's class, `mtp/vllm.py`), `target_model_type`
and `num_nextn_predict_layers`; from the module or from its checkpoint files (`generators.vllm.export`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...generators.vllm.export import (DrafterExport, as_loaded, checked_files, entries_of, loaded_dtype,
                                       write_export)
from ...generators.vllm.plugin import MTP_ARCHITECTURE
from ...models.config import ModelConfig
from .model import MTP, MTPConfig


def mtp_config(cfg: ModelConfig, mtp: MTPConfig, dtype: torch.dtype) -> dict:
    """config.json of the MTP drafter directory for target config `cfg`; refuses a layer kind vLLM would not build."""
    n, depths = cfg.num_hidden_layers, mtp.num_layers
    # Our MTP layer copies the trunk's last layer (dense or MoE); vLLM builds layer n + i by the same rule as the
    # trunk's layers (`decoder_sparse_step`, `mlp_only_layers`), which may give the other kind: refuse before any
    # engine.
    if any(cfg.is_moe_layer(n + i) != cfg.is_moe_layer(n - 1) for i in range(depths)):
        raise NotImplementedError(f"vLLM backend: with decoder_sparse_step={cfg.decoder_sparse_step} and "
                                  f"mlp_only_layers={cfg.mlp_only_layers}, vLLM would build an MTP layer of another "
                                  "kind (dense vs MoE) than the trunk's last layer our MTP layer copies")
    # model_type "mtp" is what makes vLLM accept the directory as an MTP drafter; the target's own family is kept
    # in `target_model_type` for our class to build the matching decoder layer.
    return {**cfg.to_hf(), "model_type": "mtp", "target_model_type": cfg.model_type,
            "architectures": [MTP_ARCHITECTURE], "num_nextn_predict_layers": depths,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def export_mtp(drafter: MTP, out_dir: str | os.PathLike) -> Path:
    config = mtp_config(drafter.target_config, drafter.mtp_config, next(drafter.parameters()).dtype)
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    return write_export(out_dir, config, entries_of(tensors), tensors.__getitem__)


def export_mtp_files(src: Path, target: ModelConfig, out_dir, dtype: torch.dtype) -> DrafterExport:
    """`export_mtp`'s directory from a checkpoint in our layout, tensor by tensor (`export.export_drafter_files`)."""
    dcfg, files = checked_files(src, target, "mtp")
    config = mtp_config(target, dcfg, dtype)
    entries = {n: (loaded_dtype(d, dtype), shape) for n, (d, shape) in files.meta.items()}
    return DrafterExport(write_export(out_dir, config, entries, lambda n: as_loaded(files.get(n), dtype).contiguous()),
                         None)
