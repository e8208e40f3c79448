"""Bad input fails before any engine starts, with a message that says what to do."""

import pytest

from megatron_spec.drafters.config import SpecConfig

from .common import vllm_only

pytestmark = vllm_only


def test_history_without_its_extra_names_it(monkeypatch):
    """`history` drafts in vLLM through suffix decoding, which imports Arctic Inference: where it is missing (hidden
    here, so the test holds either way) the generator refuses before any engine starts, naming the extra."""
    import importlib.util

    from megatron_spec.generators.vllm import VLLMGenerator

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "arctic_inference"
                        else real(name, *a))
    with pytest.raises(ValueError, match=r"history.*suffix.*megatron-spec\[suffix\]"):
        VLLMGenerator("checkpoints/tiny-qwen3", SpecConfig("history", 3))


def test_model_drafters_need_a_directory():
    from megatron_spec.generators.vllm import VLLMGenerator

    with pytest.raises(ValueError, match="needs SpecConfig.model"):
        VLLMGenerator("checkpoints/tiny-qwen3", SpecConfig("mtp", 3))


def test_not_a_model_directory(tmp_path):
    from megatron_spec.generators.vllm import VLLMGenerator

    with pytest.raises(FileNotFoundError, match="not an HF-layout model directory"):
        VLLMGenerator(str(tmp_path))
