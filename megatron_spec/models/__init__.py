"""Model code: one decoder for Qwen3, Qwen3-MoE and Llama, HF checkpoint I/O."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import CausalLM, TrunkOutput
from .hf_io import from_pretrained, save_pretrained
from .presets import PRESETS, preset

__all__ = [
    "SUPPORTED_MODEL_TYPES", "ModelConfig", "CausalLM", "TrunkOutput", "from_pretrained", "save_pretrained",
    "PRESETS", "preset",
]
