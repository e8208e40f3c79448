"""The transformers config class of our exported MTP drafters (`model_type: "mtp"`), module-level so that vLLM can
pickle it into the engine processes it spawns."""

from __future__ import annotations

from transformers import PretrainedConfig


class MegatronSpecMTPConfig(PretrainedConfig):
    """The target's HF config fields plus `target_model_type` (the target's family) and `num_nextn_predict_layers`."""

    model_type = "mtp"
