"""What one draft model forward costs in the simulator (the registry entry's `sim_shape`)."""

from __future__ import annotations

from ...models.config import ModelConfig
from ...models.presets import preset
from ...sim.shapes import CostShape, shape_of


def draft_model_shape(target: ModelConfig, draft_model: str, layers: int, draft_vocab: int,
                      kv_dtype_bytes: float) -> CostShape:
    """A separate draft model: the full decoder of the preset `draft_model`."""
    if not draft_model:
        raise ValueError("drafter kind 'model' needs a draft model preset name (e.g. tiny-draft)")
    return shape_of(preset(draft_model), name=draft_model, kv_dtype_bytes=kv_dtype_bytes)
