"""A draft model for vLLM from its checkpoint files: an HF model directory, linked, once its vocabulary is checked."""

from __future__ import annotations

from pathlib import Path

import torch

from ...generators.vllm.export import DrafterExport, link_model
from ...models.config import ModelConfig
from ...models.hf_io import read_config
from ..files import check_draft_model


def export_draft_model_files(src: Path, target: ModelConfig, out_dir, dtype: torch.dtype) -> DrafterExport:
    check_draft_model(read_config(src), target)
    return DrafterExport(link_model(src, out_dir, str(dtype).removeprefix("torch.")), None)
