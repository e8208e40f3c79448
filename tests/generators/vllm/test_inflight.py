"""In-flight refits on vLLM (`VLLMGenerator.refit_in_flight`): new weights handed in from another thread while the
engine generates are taken between two engine steps; the unfinished requests continue from their tokens under the
new weights. One `draft_model` engine (k = 3) on a random tiny Qwen3 A, refit mid-generation to a perturbed B with
its own draft model, so the drafter switches with the policy; and the tiny job on Ray with a vLLM engine."""

import threading
import time

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.speculative.sampling import processed_logprobs

from .common import perturbed, random_qwen3, stream, vllm_only

pytestmark = vllm_only

PROMPTS = [[1, 20, 21, 22, 15, 3], [1, 30, 31, 5, 7], [1, 9, 9, 8], [1, 40, 41, 42, 43, 44, 45, 46], [1, 5]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_spec.generators.vllm.export import export_target

    root = tmp_path_factory.mktemp("vllm_inflight")
    a = random_qwen3(0)
    b = perturbed(a, seed=5, scale=0.05)
    draft_a, draft_b = perturbed(a, seed=2, scale=0.05), perturbed(b, seed=3, scale=0.05)
    export_target(a, root / "target")
    export_target(draft_a, root / "draft")
    return {"a": a, "b": b, "draft_a": draft_a, "draft_b": draft_b, "root": root}


@pytest.fixture(scope="module")
def engine(models):
    from megatron_spec.generators.vllm import VLLMGenerator

    root = models["root"]
    gen = VLLMGenerator(str(root / "target"), SpecConfig("draft_model", 3, model=str(root / "draft")),
                        drafter=models["draft_a"], max_model_len=512)
    yield gen
    gen.close()


def generate_with_refit(gen, params, after_steps: int, model, drafter, version: int):
    """`gen.generate(PROMPTS)` with `model` and `drafter` refit in from another thread after `after_steps` engine
    steps; the completions and each request's token count when the generating thread took the refit."""
    engine = gen.llm.llm_engine
    step, refit, count, at, caller = engine.step, gen.refit, [0], [], []

    def counted():
        outs = step()
        count[0] += 1
        if count[0] == after_steps:
            load = lambda: gen.update_weights(stream(model, drafter))  # noqa: E731
            caller.append(threading.Thread(target=gen.refit_in_flight, args=(load, version)))
            caller[0].start()
            while not gen.refits.due:
                time.sleep(0.001)
        return outs

    def recorded(load, version):
        at.extend(len(t) for t in gen.running.tokens)
        return refit(load, version)

    engine.step, gen.refit = counted, recorded
    try:
        outs = gen.generate(PROMPTS, params)
    finally:
        del engine.step, gen.refit
    caller[0].join()
    return outs, at


def test_greedy_switch_equals_our_engine_refit_at_the_same_boundary(models, engine):
    """Greedy, refit after 6 engine steps: each request's tokens equal our engine generating its first t tokens
    with A and the rest with B from there (t: its token count when the refit came), token for token, and its
    versions are 0 for those t tokens and 1 after. Some requests really switch mid-rollout."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs, at = generate_with_refit(engine, params, 6, models["b"], models["draft_b"], 1)
    assert any(0 < t < MAX_TOKENS for t in at), at
    for prompt, out, t in zip(PROMPTS, outs, at):
        first = LLMEngine(models["a"]).generate([prompt], SamplingParams(temperature=0, max_tokens=t,
                                                                         ignore_eos=True))[0].token_ids if t else []
        rest = LLMEngine(models["b"]).generate([prompt + first], SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS - t, ignore_eos=True))[0].token_ids
        assert out.token_ids == first + rest, (prompt, t)
        assert out.versions == [0] * t + [1] * (MAX_TOKENS - t)


def test_sampled_logprobs_are_each_tokens_own_policy(models, engine):
    """Sampled at T = 1 from A (refit back first, as version 2), switched to B (version 3) after 5 engine steps:
    each token's log-prob equals the processed log-prob of the model its version names on a teacher-forced forward
    within 1e-4 (fp32 on both sides, differing in summation order only, as `test_lossless` states): after the
    switch vLLM computed the requests' keys and values again under B."""
    engine.refit_in_flight(lambda: engine.update_weights(stream(models["a"], models["draft_a"])), 2)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    outs, at = generate_with_refit(engine, params, 5, models["b"], models["draft_b"], 3)
    assert any(0 < t < MAX_TOKENS for t in at), at
    for prompt, out, t in zip(PROMPTS, outs, at):
        assert out.versions == [2] * t + [3] * (MAX_TOKENS - t)
        ids = torch.tensor([prompt + out.token_ids])
        ref = []
        for model in (models["a"], models["b"]):
            with torch.no_grad():
                lp = processed_logprobs(model(ids)[0, len(prompt) - 1: -1], 1.0, 0, 1.0)
            ref.append(lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0])
        expected = torch.cat([ref[0][:t], ref[1][t:]])
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (prompt, t)


def test_ray_async_run_with_in_flight_updates(tmp_path):
    """The tiny job with its online MTP drafter on Ray, one vLLM engine, lag 2 with in-flight updates, 4 steps of
    128-token rollouts: generation takes longer than an update, so some steps' rollouts span two versions (the
    engine's actor took the refit in the middle of a generation, through its second concurrency group); the lag
    stays within 2 and the exported drafter still drafts after every switch (acceptance length above 2, as
    `test_rl_loop` asks of the synchronous run)."""
    ray = pytest.importorskip("ray", reason="needs Ray: pip install 'megatron-spec[ray]'")
    from megatron_spec.placement.driver import train
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.logging import read_metrics

    cfg = RLConfig()
    cfg.run.steps, cfg.run.out_dir, cfg.run.eval_every, cfg.run.report = 4, str(tmp_path), 0, False
    cfg.run.resume, cfg.run.save_every = False, 100
    cfg.backend.generator, cfg.backend.placement, cfg.backend.async_lag = "vllm", "disaggregated", 2
    cfg.backend.in_flight_updates, cfg.grpo.max_tokens = True, 128
    cfg.drafter_train.gate = False  # every step speculates (the gate would start with plain steps)
    started = not ray.is_initialized()  # the Ray tests' cluster when they run in the same session
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        train(cfg)
    finally:
        if started:
            ray.shutdown()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert max(r["rollout_version_span_max"] for r in rows) >= 2
    for r in rows:
        assert r["policy_lag"] <= 2 and r["acceptance_length"] > 2, r
