"""Model code: one decoder for Qwen3, Qwen3-MoE and Llama, HF checkpoint I/O, drafter heads."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import CausalLM, TrunkOutput
from .drafters import check_draft_model, load_drafter, save_drafter, target_fingerprint
from .eagle3 import Eagle3Config, Eagle3Head, captured_layers, default_capture_layers
from .hf_io import from_pretrained, save_pretrained
from .mtp import MTP, MTPConfig
from .presets import PRESETS, preset

__all__ = [
    "SUPPORTED_MODEL_TYPES", "ModelConfig", "CausalLM", "TrunkOutput", "from_pretrained", "save_pretrained",
    "PRESETS", "preset", "MTP", "MTPConfig", "Eagle3Head", "Eagle3Config", "default_capture_layers", "captured_layers",
    "save_drafter", "load_drafter", "check_draft_model", "target_fingerprint",
]
