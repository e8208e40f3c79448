"""The embedded default on one GPU (`run.device=cuda`): the main job, losslessness of speculative decoding and the
log-probs the engine and the trainer compute, against the CPU. The CPU suite's helpers are imported, not copied.

Tolerances: fp32 throughout with TF32 off (torch's default for matmuls; set explicitly below), so a CUDA kernel
differs from the CPU's only in the order it sums: a few ulps per reduction, ~1e-6 relative through the tiny
model's layers. A log-prob is a difference of logits and a logsumexp of magnitude < 20, so 1e-4 absolute leaves
a margin of ~10x over that error while a wrong distribution (a wrong temperature, a stale token, a shifted
position) moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.rl import checkpoint, loop
from megatron_spec.rl.logging import read_metrics
from megatron_spec.rl.overrides import apply_overrides
from megatron_spec.trainers.embedded import EmbeddedPolicy

from ..rl.test_loop import ckpts, small_cfg  # noqa: F401  (fixture)
from ..speculative.test_engine_spec import PROMPTS, SAMPLED, assert_logprobs_equal_full_forward, assert_sampled_matches_plain, drafters

ATOL = 1e-4
"""Log-prob agreement across devices and kernels (module docstring)."""


@pytest.fixture(scope="module")
def cuda_target(tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return tiny_model.to("cuda")


def test_main_job_runs_on_cuda_and_resumes_on_cpu(tmp_path):
    """The README's main job (the tiny recipe's config) for 3 steps with `run.device=cuda`: every step's engine
    log-probs agree with the trainer's (`logprob_mismatch` <= 1e-4), speculation drafts and is accepted, the loss
    is finite; its checkpoint then loads into a CPU run with every tensor equal to the saved one (no device is
    part of a checkpoint) and that run takes a step. The adaptive controller is off so that the speculative path
    runs every step whatever it would measure on this GPU."""
    from recipes.tiny_grpo_spec import tiny_grpo_spec

    overrides = ["run.steps=3", "run.save_every=3", "run.eval_every=0", "run.report=false", f"run.out_dir={tmp_path}",
                 "spec.adaptive=false"]
    cfg = apply_overrides(tiny_grpo_spec(), [*overrides, "run.device=cuda"])
    loop.train(cfg)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["logprob_mismatch"] <= ATOL and math.isfinite(r["loss"]) and not r["skipped"]
        assert r["acceptance_length"] > 1

    saved = checkpoint.load_latest(tmp_path)
    assert all(t.device.type == "cpu" for t in saved["state"]["model"].values())
    cpu = loop.Trainer(apply_overrides(tiny_grpo_spec(), [*overrides, "run.steps=4", "run.device=cpu"]))
    cpu.policy.load_state_dict(saved["state"])
    for name, t in cpu.policy.model.state_dict().items():
        assert torch.equal(t, saved["state"]["model"][name]), name
    assert cpu.policy.opt.state_dict()["state"][0]["exp_avg"].device.type == "cpu"
    assert math.isfinite(cpu.step(3)["loss"])


@pytest.mark.parametrize("name", ["ngram", "draft_model", "mtp", "eagle3"])
def test_greedy_identity_on_cuda(cuda_target, name):
    """Speculative greedy decoding emits the plain engine's tokens on the GPU too (batch capacity 4 for 6 prompts).
    The tiny target's std-0.15 weights give peaked distributions, so no argmax is a near-tie at fp32 precision."""
    spec, drafter = drafters(cuda_target)[name]
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = LLMEngine(cuda_target, max_num_seqs=4).generate(PROMPTS, params)
    fast = LLMEngine(cuda_target, max_num_seqs=4, spec=spec, drafter=drafter).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert sum(o.spec.get("drafted", 0) for o in fast) > 0


@pytest.mark.parametrize("kw", SAMPLED)
def test_sampled_speculation_is_lossless_on_cuda(cuda_target, kw):
    """The CPU suite's chi-square test (tests/speculative: 2000 completions, 99.9 % threshold per position, false alarm
    0.001 each) with the target, the drafter and the verifier on the GPU, beside its power control (plain decoding
    at 0.75 times the temperature rejected at each position; power >= 0.997, `assert_matches_plain`)."""
    assert_sampled_matches_plain(cuda_target, kw)


@pytest.mark.parametrize("name", ["draft_model", "mtp", "history"])
def test_engine_logprobs_on_cuda_equal_a_cpu_forward(cuda_target, name):
    """Log-probs the engine returns on the GPU (sampled, accepted drafts and residual / bonus tokens) equal a full
    forward's on the GPU and on the CPU (a copy of the same weights) within `ATOL`."""
    spec, drafter = drafters(cuda_target)[name]
    kw = dict(temperature=0.8, top_p=0.9)
    outs = LLMEngine(cuda_target, spec=spec, drafter=drafter).generate(PROMPTS, SamplingParams(max_tokens=20, seed=2, **kw))
    assert_logprobs_equal_full_forward(cuda_target, outs, kw, atol=ATOL)
    cpu_target = type(cuda_target)(cuda_target.config)
    cpu_target.load_state_dict({k: v.cpu() for k, v in cuda_target.state_dict().items()})
    assert_logprobs_equal_full_forward(cpu_target.eval(), outs, kw, atol=ATOL)


def test_trainer_logprobs_on_cuda_equal_cpu(ckpts, tmp_path):  # noqa: F811
    """The trainer's recomputed log-probs of one step's rollouts on the GPU equal the same trainer's on the CPU
    within `ATOL`, and come back on the host."""
    cfg = small_cfg(ckpts, tmp_path, fold_logprob=False)
    trainer = loop.Trainer(cfg)
    problems, prompts = trainer.draw(0)
    outs = trainer.rollouts(0, prompts).outs
    batch, _ = loop.make_batch(prompts, outs)
    on_gpu = EmbeddedPolicy.from_rl(cfg, from_pretrained(cfg.model.policy, device="cuda"))
    gpu_lp = on_gpu.logprobs(batch)
    assert gpu_lp.device.type == "cpu"
    torch.testing.assert_close(gpu_lp, trainer.policy.logprobs(batch), atol=ATOL, rtol=0)
