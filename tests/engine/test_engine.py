"""The plain engine against naive references: greedy identity, exact logprobs, batching invariance, bad input."""

import numpy as np
import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models.decoder import weights_fixed
from megatron_spec.speculative.sampling import processed_logprobs

from ..speculative.stats import assert_rejects, chi2_quantile_999, goodness_of_fit, noncentrality_gof
from .conftest import naive_greedy

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21], [30, 31, 32, 33], [40] * 9]


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_moe"])
def test_greedy_equals_naive_reference(model_name, request):
    model = request.getfixturevalue(model_name)
    outs = LLMEngine(model, max_num_seqs=4).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == naive_greedy(model, prompt, 12)
        assert out.finish_reason == "length" and out.prompt_len == len(prompt)


def test_continuous_batching_equals_one_by_one(tiny_model):
    """Batch capacity 2 with 6 prompts forces joins and leaves; outputs equal generating each prompt alone."""
    params = SamplingParams(temperature=0, max_tokens=15)
    batched = LLMEngine(tiny_model, max_num_seqs=2).generate(PROMPTS, params)
    alone = [LLMEngine(tiny_model, max_num_seqs=1).generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_p=0.8),
                                dict(temperature=0.8, top_k=7)])
def test_logprobs_equal_full_forward_recompute(tiny_model, kw):
    """Each returned logprob equals log p(token) from one full forward over prompt + completion, under the same
    processed distribution (within 1e-5, fp32); sampled tokens are inside the top-k / top-p support."""
    outs = LLMEngine(tiny_model, max_num_seqs=3).generate(PROMPTS, SamplingParams(max_tokens=10, seed=3, **kw))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp = processed_logprobs(tiny_model(ids)[0, len(prompt) - 1 : -1], **kw)
        ref = lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(ref).all()
        assert np.allclose(out.logprobs, ref.numpy(), atol=1e-5)


def test_sampling_is_seeded_and_batch_invariant(tiny_model):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11)
    a = LLMEngine(tiny_model, max_num_seqs=6).generate(PROMPTS, params)
    b = LLMEngine(tiny_model, max_num_seqs=2).generate(PROMPTS, params)
    c = LLMEngine(tiny_model, max_num_seqs=6).generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, seed=12))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_sequences_that_share_a_prompt_share_its_prefill(tiny_model):
    """Two prompts, each asked for three times in mixed order (a GRPO group need not be adjacent), with a third
    prompt once: the prefill forward runs 3 rows, not 7; every copy's slot holds its leader's keys and values
    bitwise over the prompt, with the same length; and every sampled token's logprob equals one full forward's over
    prompt + completion (1e-5, fp32, as above), which fails where a copy's cache or hidden-state row is another
    prompt's. The copies' samples differ (each sequence draws from its own stream: 10 tokens at T = 1 from the
    tiny model agreeing three times over has a chance far below 1e-6), and greedy decoding gives each copy what
    the prompt gives alone. The distribution test below samples 3000 copies of one prompt through the same path."""
    a, b, c = [5, 6, 7], [8, 9, 10, 11, 12], [3]
    prompts = [a, b, a, c, b, a, b]
    engine = LLMEngine(tiny_model, max_num_seqs=8)
    rows, trunk = [], tiny_model.trunk

    def counted(ids, *args, **kwargs):
        rows.append(ids.shape[0])
        return trunk(ids, *args, **kwargs)

    tiny_model.trunk = counted
    try:
        seqs = engine.start(prompts, SamplingParams(temperature=1.0, max_tokens=10, seed=4))
        with torch.inference_mode(), weights_fixed():
            engine.step()  # the prefill
        assert rows == [3]
        for s in seqs:
            leader = seqs[prompts.index(s.prompt)]
            n = len(s.prompt)
            assert s.num_cached == n
            assert torch.equal(engine.cache.k[:, s.slot, ..., :n], engine.cache.k[:, leader.slot, ..., :n])
            assert torch.equal(engine.cache.v[:, s.slot, :, :n], engine.cache.v[:, leader.slot, :, :n])
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, seed=4))
    finally:
        del tiny_model.trunk
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            lp = processed_logprobs(tiny_model(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1 : -1], 1.0)
        assert np.allclose(out.logprobs, lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1), atol=1e-5)
    assert len({tuple(outs[i].token_ids) for i in (0, 2, 5)}) > 1 and len({tuple(outs[i].token_ids) for i in (1, 4, 6)}) > 1
    greedy = SamplingParams(temperature=0, max_tokens=10)
    shared = engine.generate(prompts, greedy)
    assert [o.token_ids for o in shared] == [naive_greedy(tiny_model, p, 10) for p in prompts]


def test_first_token_distribution_matches_model(tiny_model):
    """3000 one-token samples of the same prompt (each from its own seeded stream) against the processed
    distribution (T=0.7, top-k 6): Pearson chi-square with 5 degrees of freedom against its 99.9 % quantile
    (`chi2_quantile_999`: 20.75, above the exact 20.52), so a correct sampler fails this with probability < 0.001
    for a given seed, and the seed is fixed.

    Power control: 3000 samples at 0.75 times the temperature (T = 0.525, top-k 6, another seed) against the same
    p must be rejected: lambda 68 on df 5, power 1 - 3e-5 (asserted >= 0.99, computed here from p). A 5 %
    temperature error moves these six close tokens (p 0.08-0.32) too little for 3000 samples (lambda 1.5, power
    0.005; ~87000 would be needed): test_verify.py's sampler-level tests have that power."""
    prompt, n = [7, 8, 9], 3000
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt]))[0, -1]
    p = processed_logprobs(logits, 0.7, 6).exp()
    cool = processed_logprobs(logits, 0.7 * 0.75, 6).exp()

    def counts(temperature: float, seed: int) -> np.ndarray:
        params = SamplingParams(temperature=temperature, top_k=6, max_tokens=1, seed=seed)
        outs = LLMEngine(tiny_model, max_num_seqs=256).generate([prompt] * n, params)
        return np.bincount([o.token_ids[0] for o in outs], minlength=p.numel())

    chi2, df = goodness_of_fit(counts(0.7, 5), p.numpy())  # fails if a token outside the top 6 is drawn
    assert df == 5 and chi2 <= chi2_quantile_999(df)
    assert_rejects(*goodness_of_fit(counts(0.7 * 0.75, 6), p.numpy()), noncentrality_gof(p.numpy(), cool.numpy(), n))


def test_stop_tokens_and_context_cap(tiny_model):
    greedy = LLMEngine(tiny_model).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0]
    stop = greedy.token_ids[4]
    first = greedy.token_ids.index(stop)
    out = LLMEngine(tiny_model).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                                     stop_token_ids=(stop,)))[0]
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop"
    ctx = tiny_model.config.max_position_embeddings
    out = LLMEngine(tiny_model).generate([[5] * (ctx - 3)], SamplingParams(temperature=0, max_tokens=50))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_input_is_rejected_before_work(tiny_model):
    engine = LLMEngine(tiny_model)
    ctx = tiny_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="empty prompt list"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="longer than the model's context"):
        engine.generate([[1] * ctx], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 64]], SamplingParams())
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


def test_cache_stores_keys_transposed_and_reads_back_what_was_written():
    """Two sequences in slots 2 and 0 (not contiguous), writing 3 tokens each at positions 5.. and 9.. of layer 1:
    the cache holds each key at [layer, slot, head, :, position] (transposed) and each value at [layer, slot, head,
    position, :], the other layer and slot stay zero, and the view gives back keys and values in [B, heads, kv_len,
    head_dim] exactly as written, the keys as a view of the store (no copy)."""
    from megatron_spec.models.kv_cache import KVCache

    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 3, 40, 2, 4)
    view = cache.view([2, 0], [5, 9], 3)
    k, v = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
    keys, values, _ = view.update(1, k, v)
    for b, (slot, start) in enumerate(((2, 5), (0, 9))):
        for t in range(3):
            assert torch.equal(cache.k[1, slot, :, :, start + t], k[b, :, t])
            assert torch.equal(cache.v[1, slot, :, start + t], v[b, :, t])
            assert torch.equal(keys[b, :, start + t], k[b, :, t]) and torch.equal(values[b, :, start + t], v[b, :, t])
    assert cache.k[0].abs().sum() == 0 and cache.k[1, 1].abs().sum() == 0 and cache.v[1, 1].abs().sum() == 0
    assert int((cache.k != 0).sum()) == int((cache.v != 0).sum()) == k.numel()
    contiguous = cache.view([0, 1], [0, 0], 1)
    keys, _, _ = contiguous.update(0, k[:, :, :1], v[:, :, :1])
    assert keys.data_ptr() == cache.k[0].data_ptr() and keys.shape == (2, 2, 16, 4)


def test_attention_reads_the_cache_in_blocks():
    """Attention reads keys up to the batch's longest position + 1 rounded up to KV_BLOCK (16) and capped at the
    cache's length. A prefix that grows by one key a step then changes the attention matmuls' shape once every 16
    steps (bf16 matmuls build a oneDNN kernel per shape). The extra keys are masked out; the logprob test above
    runs through them at 1e-5."""
    from megatron_spec.models.kv_cache import KV_BLOCK, KVCache

    assert KV_BLOCK == 16
    cache = KVCache(1, 2, 40, 1, 4)
    assert cache.view([0, 1], [3, 20], 1).kv_len == 32  # positions 3 and 20: 21 keys -> 32
    assert cache.view([0], [0], 5).kv_len == 16
    assert cache.view([0], [15], 1).kv_len == 16
    assert cache.view([0], [36], 2).kv_len == 40  # 38 keys -> 48, capped at the cache's 40
    view = cache.view([0, 1], [3, 20], 1)
    assert torch.isinf(view.mask[0, 0, 0, 4:]).all() and (view.mask[0, 0, 0, :4] == 0).all()
