"""MoE routing replay with vLLM as the generator (`generators/vllm/routing.py`): each worker records the experts
its routers chose at every position of every request, and the trainer replays them.

- Recorded routing equals the routing of our model's own forward over each rollout (fp32 on both sides, a random
  tiny MoE whose routers have no crafted ties), position by position, in top-k order, for the prompt and every
  generated token but the last.
- With crafted near ties between two experts and a trainer whose routers differ from the engine's by as much as
  the ties' gaps, the trainer replaying vLLM's routing chooses vLLM's experts at every recorded position, where
  routing by itself it chooses others at some, and the engine-vs-trainer log-prob mismatch shows it.
- The loop with the vLLM generator speculating (the shipped tiny MoE and its MTP head, k = 3): the batch the
  trainer gets holds routing at exactly the positions a trainer forward reads, and the mismatch is fp32 rounding.
  Under speculation a rejected draft's row is replaced by the row of the token sampled at its position: any row
  left from a rejected draft would route that position differently from the model's forward, which the first
  test's equality, run here on the speculating engine too, would catch."""

import numpy as np
import pytest
import torch

from megatron_spec.engine import SamplingParams
from megatron_spec.models import CausalLM, preset
from megatron_spec.models.routing import choices
from megatron_spec.rl.config import GRPOSection, RLConfig
from megatron_spec.rl.loop import make_batch
from tests.rl.test_routing_replay import check_replay, near_tie_models

from .common import vllm_only

pytestmark = vllm_only

PROMPTS = [p for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]) for _ in range(4)]
SAMPLED = SamplingParams(max_tokens=24, seed=5, ignore_eos=True)


def engine_for(model, root):
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target

    return VLLMGenerator(str(export_target(model, root)), max_model_len=256, record_routing=True)


def own_routing(model, prompt, tokens) -> np.ndarray:
    """[prompt + tokens - 1, MoE layers, top_k]: the experts our model's forward over the rollout routes to."""
    seq = prompt + tokens
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]))
    return choices(model, 1, len(seq) - 1)[0].numpy()


def test_recorded_routing_is_the_models_own(tmp_path):
    """16 sampled rollouts of 24 tokens: vLLM's recorded routing equals our model's forward's, exactly."""
    torch.manual_seed(3)
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    model.reset_parameters(std=0.15)
    gen = engine_for(model, tmp_path / "moe")
    try:
        outs = gen.generate(PROMPTS, SAMPLED)
    finally:
        gen.close()
    for prompt, out in zip(PROMPTS, outs):
        assert out.routing.shape == (len(prompt) + 23, 4, 2)
        np.testing.assert_array_equal(out.routing, own_routing(model, prompt, out.token_ids))


def test_trainer_replays_vllms_routing(tmp_path):
    """The near-tie engine model on vLLM, the perturbed trainer (`near_tie_models`): replaying, the trainer's
    log-prob and train forwards choose vLLM's experts at every recorded position; routing by itself it chooses
    others at some (at least 5; observed in the same setup on our engine: 110 of 432), and the mismatch with vLLM's
    log-probs is above 0.25 without replay and below 0.1 with it (the bounds of the embedded engine's test, whose
    reasoning holds here: the engine's log-probs are fp32 on both)."""
    engine, trainer = near_tie_models()
    gen = engine_for(engine, tmp_path / "near_tie")
    try:
        outs = gen.generate(PROMPTS, SAMPLED)
    finally:
        gen.close()
    check_replay(trainer, *make_batch(PROMPTS, outs))


def test_a_loop_step_with_vllm_speculating_carries_the_routing(tmp_path):
    """One loop step, the vLLM generator speculating with the shipped tiny MoE's MTP head (k = 3): the trainer's
    batch holds routing at every input position of every rollout but its last token, -1 elsewhere, each rollout's
    rows equal our model's own forward over it, and the engine-vs-trainer mismatch is fp32 rounding (< 1e-4)."""
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.models import from_pretrained
    from megatron_spec.rl import loop

    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter = "checkpoints/tiny-qwen3-moe", "checkpoints/tiny-qwen3-moe-mtp"
    cfg.spec = SpecConfig("mtp", 3)
    cfg.backend.generator = "vllm"
    cfg.grpo = GRPOSection(prompts_per_step=2, group_size=2, max_tokens=12, routing_replay=True)
    cfg.run.out_dir, cfg.run.steps, cfg.run.threads, cfg.run.eval_every, cfg.run.report = str(tmp_path), 1, 1, 0, False
    loop.check_inputs(cfg)
    trainer = loop.Trainer(cfg)
    try:
        seen, outs = [], []
        train_step, generate = trainer.policy.train_step, trainer.generator.generate
        trainer.policy.train_step = lambda batch, **kw: seen.append(batch) or train_step(batch, **kw)
        trainer.generator.generate = lambda *a, **kw: outs.extend(generate(*a, **kw)) or outs
        metrics = trainer.step(0)
    finally:
        trainer.close()
    [batch] = seen
    B, T = batch.input_ids.shape
    assert batch.routing.shape == (B, T, 4, 2)
    last = batch.mask.int().cumsum(1).argmax(1)
    assert torch.equal(batch.routing[..., 0, 0] >= 0, torch.arange(T)[None] < last[:, None])
    assert sum(o.spec.get("drafted", 0) for o in outs) > 0
    model = from_pretrained(cfg.model.policy)
    _, prompts = trainer.draw(0)
    for prompt, out in zip(prompts, outs):
        np.testing.assert_array_equal(out.routing, own_routing(model, prompt, out.token_ids))
    assert metrics["logprob_mismatch"] < 1e-4
