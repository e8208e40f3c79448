"""Bad input fails before any engine starts, with a message that says what to do."""

import pytest

from megatron_spec.spec.config import SpecConfig

from .common import vllm_only

pytestmark = vllm_only


def test_history_has_no_vllm_counterpart(tmp_path):
    from megatron_spec.backends.vllm import VLLMGenerator

    with pytest.raises(ValueError, match="history.*no vLLM counterpart"):
        VLLMGenerator("checkpoints/tiny-qwen3", SpecConfig("history", 3))


def test_model_drafters_need_a_directory():
    from megatron_spec.backends.vllm import VLLMGenerator

    with pytest.raises(ValueError, match="needs SpecConfig.model"):
        VLLMGenerator("checkpoints/tiny-qwen3", SpecConfig("mtp", 3))


def test_not_a_model_directory(tmp_path):
    from megatron_spec.backends.vllm import VLLMGenerator

    with pytest.raises(FileNotFoundError, match="not an HF-layout model directory"):
        VLLMGenerator(str(tmp_path))
