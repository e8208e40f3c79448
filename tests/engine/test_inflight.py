"""In-flight refits: new weights handed to the engine from another thread while it generates are taken between two
steps. Greedy rollouts that switch weights at token boundary t equal a plain engine that generates t tokens with
weights A, is refit to B and continues; each token's recorded version says which weights sampled it; the drafter
switches with the policy; the log-probs are each token's own policy's."""

import copy
import threading
import time

import numpy as np
import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.engine.engine import token_versions
from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.refit import load_buckets, named_weights
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.speculative.sampling import processed_logprobs

from .conftest import naive_greedy, noisy_copy

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21], [30, 31, 32, 33], [40] * 9]
MAX_TOKENS = 14


def engine_with(model, spec=None, drafter=None, max_num_seqs=4):
    """An engine on copies of `model` and `drafter` (the refit loads into them), and its drafter copy."""
    drafter = copy.deepcopy(drafter) if drafter is not None else None
    return LLMEngine(copy.deepcopy(model), max_num_seqs=max_num_seqs, spec=spec, drafter=drafter), drafter


def generate_with_refit(engine, drafter, prompts, params, after_steps: int, model_b, drafter_b=None):
    """`engine.generate` with weights B (and drafter B, into `drafter`) handed in from another thread after
    `after_steps` steps; returns the completions and each sequence's output length when the refit was asked for."""
    step, count, at, caller = engine.step, [0], [], []

    def load():
        return load_buckets(engine.model, drafter, [list(named_weights(model_b, drafter_b))])

    def counted():
        step()
        count[0] += 1
        if count[0] == after_steps:
            at.extend(len(s.output) if s.output else 0 for s in engine.seqs)
            caller.append(threading.Thread(target=engine.refits.refit, args=(engine, load, 1)))
            caller[0].start()
            while not engine.refits.due:  # the asking thread has handed it over: the next boundary takes it
                time.sleep(0.001)

    engine.step = counted
    try:
        outs = engine.generate(prompts, params)
    finally:
        del engine.step
    caller[0].join()
    return outs, at


def continued(model_a, model_b, prompt, t):
    """The reference: t greedy tokens with weights A, then the rest with B from where A stopped."""
    first = naive_greedy(model_a, prompt, t)
    return first + naive_greedy(model_b, prompt + first, MAX_TOKENS - t)


def drafters(target, target_b):
    torch.manual_seed(3)
    draft = noisy_copy(target, 0.005, 2)
    mtp, eagle = MTP(target.config, MTPConfig(1)), Eagle3Head.from_target(target)
    return {
        None: (None, None, None),
        "draft_model": (SpecConfig("draft_model", 4), draft, noisy_copy(target_b, 0.005, 4)),
        "mtp": (SpecConfig("mtp", 3), mtp, noisy_copy(mtp, 0.01, 5)),
        "eagle3": (SpecConfig("eagle3", 3), eagle, noisy_copy(eagle, 0.01, 6)),
        "ngram": (SpecConfig("ngram", 3), None, None),
    }


@pytest.mark.parametrize("method", [None, "draft_model", "mtp", "eagle3", "ngram"])
@pytest.mark.parametrize("after_steps", [1, 5])
def test_greedy_switch_equals_plain_engine_refit_at_the_same_boundary(tiny_model, method, after_steps):
    """Batch capacity 4 with 6 prompts: when the refit comes, some sequences are running (switched mid-rollout),
    two are waiting (all their tokens are B's) or done. Every sequence's tokens equal the naive greedy reference
    that generates with A up to the sequence's own boundary and with B after it, exactly (greedy: the argmax of
    either weights; a drafter only changes how many forwards it takes). Its recorded versions are 0 up to that
    boundary and 1 after it, at the right positions. Speculation stays lossless across the switch: drafts after it
    are verified by B, whatever the drafter held before."""
    target_b = noisy_copy(tiny_model, 0.05, 1)
    spec, drafter, drafter_b = drafters(tiny_model, target_b)[method]
    engine, copied = engine_with(tiny_model, spec, drafter)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs, at = generate_with_refit(engine, copied, PROMPTS, params, after_steps, target_b, drafter_b)
    switched = [t for t in at if 0 < t < MAX_TOKENS]
    assert switched, at  # some rollouts really span both versions
    for prompt, out, t in zip(PROMPTS, outs, at):
        assert out.token_ids == continued(tiny_model, target_b, prompt, t), (prompt, t)
        assert out.versions == [0] * t + [1] * (MAX_TOKENS - t)
    assert engine.version == 1


def test_drafter_switches_with_the_policy(tiny_model):
    """The first drafts after the switch are drafter B's greedy continuation of the sequence as it stands, computed
    from scratch: the draft model's weights and its cache both moved to B (a cache kept from A would draft
    otherwise: drafter B differs from A)."""
    target_b = noisy_copy(tiny_model, 0.05, 1)
    spec, drafter, drafter_b = drafters(tiny_model, target_b)["draft_model"]
    engine, copied = engine_with(tiny_model, spec, drafter, max_num_seqs=6)
    seen = []
    propose = engine.propose

    def recording(seqs):
        drafts = propose(seqs)
        if engine.version == 1 and not seen:
            seen.extend((list(s.tokens), min(4, s.remaining - 1), list(d)) for s, d in zip(seqs, drafts.tokens))
        return drafts

    engine.propose = recording
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    generate_with_refit(engine, copied, PROMPTS, params, 3, target_b, drafter_b)
    assert len(seen) == len(PROMPTS)
    for tokens, budget, drafts in seen:  # k = 4 drafts, fewer where the sequence ends sooner
        assert drafts == naive_greedy(drafter_b, tokens, budget)


def test_sampled_logprobs_are_each_tokens_own_policy(tiny_model):
    """Sampled (temperature 0.8, top-k 20) rollouts switching weights mid-flight: each token's log-prob equals a
    full forward of the weights its version names over prompt + completion, within 1e-5: after the switch the keys
    and values are computed again under B, so no token reads A's cache. (1e-5: both are fp32 log-softmaxes of the
    same weights and tokens, differing only in summation order; a token sampled through A's cache would differ by
    the weights' difference, ~1e-2.)"""
    target_b = noisy_copy(tiny_model, 0.05, 1)
    engine, _ = engine_with(tiny_model)
    kw = dict(temperature=0.8, top_k=20)
    outs, at = generate_with_refit(engine, None, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, seed=5, ignore_eos=True,
                                                                   **kw), 4, target_b)
    assert any(0 < t < MAX_TOKENS for t in at)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.token_ids])
        ref = []
        for model in (tiny_model, target_b):
            with torch.no_grad():
                lp = processed_logprobs(model(ids)[0, len(prompt) - 1: -1], **kw)
            ref.append(lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1).numpy())
        expected = np.where(np.array(out.versions) == 0, ref[0], ref[1])
        assert np.allclose(out.logprobs, expected, atol=1e-5)


def test_refit_without_a_generation_applies_at_once(tiny_model):
    """Asked for while nothing generates, a refit loads in the caller's thread and the next generation's tokens all
    carry its version."""
    engine = LLMEngine(copy.deepcopy(tiny_model), max_num_seqs=2)
    target_b = noisy_copy(tiny_model, 0.05, 1)
    loaded = engine.refits.refit(engine, lambda: load_buckets(engine.model, None, [list(named_weights(target_b))]),
                                 7)
    assert loaded > 0 and engine.version == 7
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.versions == [7] * 5 and out.token_ids == naive_greedy(target_b, [5, 6, 7], 5)


def test_token_versions():
    assert token_versions([(0, 3)], 4) == [3, 3, 3, 3]
    assert token_versions([(0, 0), (2, 1), (5, 2)], 6) == [0, 0, 1, 1, 1, 2]
    assert token_versions([(0, 0), (2, 1)], 2) == [0, 0]
