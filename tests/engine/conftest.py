import pytest
import torch

from megatron_spec.models import CausalLM, preset


@pytest.fixture(scope="module")
def tiny_model():
    """A random tiny Qwen3 with peaked next-token distributions (std 0.15 weights), so greedy paths and
    sampling both exercise non-trivial choices."""
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3")).eval()
    model.reset_parameters(std=0.15)
    return model


@pytest.fixture(scope="module")
def tiny_moe():
    torch.manual_seed(1)
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    model.reset_parameters(std=0.15)
    return model


def naive_greedy(model, prompt, n):
    """Reference decoder: a full forward over the whole sequence and an argmax, every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
