"""The fused CPU kernels (`megatron_spec.kernels`) against torch's eager path they replace, their batch invariance
(what keeps greedy speculative decoding token-identical to plain), their bounds checks, and the engine using them."""

import copy
import dataclasses

import pytest
import torch

from megatron_spec import kernels
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import CausalLM, decoder, packed, preset
from megatron_spec.models.decoder import DecoderLayer
from megatron_spec.models.kv_cache import KVCache
from megatron_spec.drafters.mtp.model import MTP, MTPConfig, MTPLayer
from megatron_spec.models.layers import RMSNorm, attend, rope_cos_sin
from megatron_spec.speculative.sampling import processed_logprobs
from megatron_spec.speculative.verify import emitted_logprobs, verify_coupled

DTYPES = [torch.float32, torch.bfloat16]
BF16_STEP = 2.0**-7
"""bf16 keeps 8 significant bits: two neighbouring values are 2^-8 to 2^-7 apart relative to their size."""


def eager(fn, *args):
    """`fn` with the kernels switched off (torch's ops), under inference mode as in the engine."""
    with kernels.disabled(), torch.inference_mode():
        return fn(*args)


def test_kernels_build_here():
    """The tests run with MEGATRON_SPEC_KERNELS=1 (conftest): a machine where they do not build fails here."""
    assert kernels.loaded()
    with torch.inference_mode():
        assert kernels.usable(torch.zeros(1))
        with kernels.disabled():
            assert not kernels.usable(torch.zeros(1))
        assert kernels.usable(torch.zeros(1))
    assert not kernels.usable(torch.zeros(1))  # outside inference mode: training's forwards keep torch's ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype):
    """fp32: the sum of 576 squares in another order (16 lanes against torch's vectorised mean) moves it by at most
    ~n * 2^-24 relative (3.4e-5), and the square root halves that; 1e-4 relative is that bound with room, and a
    kernel that dropped the weight, the eps or the mean's 1/n would be off by whole percents. bf16: the same fp32
    difference can flip the rounding of the normalised value or of its product with the weight, so outputs may
    differ by one bf16 step (2^-7 relative) and by no more; most must be equal."""
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(7, 3, 576) * 3).to(dtype)
    x[0, 0] = 0  # an all-zero row: eps keeps it finite (0, not NaN)
    with torch.inference_mode():
        got = norm(x)
    want = eager(norm, x)
    assert torch.equal(got[0, 0], torch.zeros(576, dtype=dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    else:
        diff = (got.float() - want.float()).abs()
        assert (diff <= BF16_STEP * want.float().abs() + 1e-30).all()
        assert (diff > 0).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    """silu then multiply, each rounded to the dtype: the exp differs from torch's vectorised one by an ulp or two
    (fp32: relative 1e-6 bounds it; a missing sigmoid or a swapped gate/up is off by O(1)); in bf16 such an ulp can
    move the rounding of silu(gate) by one step, hence one bf16 step on the product."""
    torch.manual_seed(0)
    gate_up = (torch.randn(5, 2, 2 * 384) * 4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    with torch.inference_mode():
        got = kernels.silu_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        assert ((got.float() - want.float()).abs() <= 2 * BF16_STEP * want.float().abs() + 1e-30).all()


def cache_and_batch(dtype, qk_norm):
    """A Qwen3- or Llama-shaped attention layer (4 query heads over 2 KV heads, head_dim 32), its KV cache with
    history in three slots, and one verify-shaped batch: slots [2, 0] (not contiguous) at ragged starts, 3 tokens."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("tiny-qwen3"), qk_norm=qk_norm)
    model = CausalLM(cfg).to(dtype).eval()
    model.reset_parameters(std=0.15)
    attn = model.model.layers[1].self_attn
    cache = KVCache(cfg.num_hidden_layers, 3, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    cache.k.normal_()
    cache.v.normal_()
    x = torch.randn(2, 3, cfg.hidden_size).to(dtype)
    return cfg, attn, cache, x, ([2, 0], [5, 17], 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_layer_matches_torch(dtype, qk_norm, monkeypatch):
    """One attention layer through the kernels against torch's path, each on its own copy of the same cache. Both
    sides project q/k/v with the same GEMM (the kernels' `linear` is turned off here and tested on its own below),
    so what differs is only what this test is about.

    The cache after the step: keys are normed (per-head RMSNorm, Qwen3 only) and rotated, values copied. The rotary
    rounds each product and the sum as torch's eager ops do (the library is built without fused multiply-adds), so
    without the per-head norm the stored keys are the same bits; with it they inherit the norm's reordered sum and
    are compared as the norm's test compares (1e-4 relative in fp32, one bf16 step).
    The output: fp32 agrees to 1e-5 (dot products of O(1) values over <= 32 keys and 32 channels). In bf16 torch's
    path rounds scores and probabilities to bf16 (2^-8 relative each) where the kernel keeps fp32, so the outputs
    (O(1) averages of values) may differ by a few bf16 steps: 0.05 absolute; a wrong mask, key or head mapping moves
    them by O(1)."""
    monkeypatch.setattr(packed, "KERNEL_ROWS", {torch.float32: 0, torch.bfloat16: 0})
    cfg, attn, cache, x, (slots, starts, T) = cache_and_batch(dtype, qk_norm)
    twin = KVCache(cfg.num_hidden_layers, 3, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    twin.k.copy_(cache.k)
    twin.v.copy_(cache.v)
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    with torch.inference_mode():
        got = attn(x, cos, sin, cache.view(slots, starts, T))
    want = eager(attn, x, cos, sin, twin.view(slots, starts, T))
    if qk_norm:
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=BF16_STEP, atol=1e-6)
        torch.testing.assert_close(cache.k, twin.k, **tol)
    else:
        assert torch.equal(cache.k, twin.k)
    assert torch.equal(cache.v, twin.v)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.05)
    torch.testing.assert_close(got, want, **tol)


def test_bf16_attention_is_closer_to_float64_than_torchs():
    """The attention kernel on bf16 inputs against a float64 reference on the same inputs: its error is at most
    torch's path's (which rounds scores and probabilities to bf16), and within one bf16 step of each output's size
    plus 1e-3 (the final rounding, and fp32 sums over 40 keys). Power: torch's own error is checked to be larger
    than that bound somewhere, so the comparison is not between two exact results."""
    torch.manual_seed(0)
    B, H, KV, D, L = 2, 4, 2, 32, 48
    q = torch.randn(B, 1, H, D).bfloat16()
    k = torch.randn(3, KV, D, L).bfloat16()  # [slots, KV, D, L], keys transposed as the cache stores them
    v = torch.randn(3, KV, L, D).bfloat16()
    slots, positions = torch.tensor([2, 0]), torch.tensor([[39], [11]])
    with torch.inference_mode():
        got = kernels.attention(q, k, v, slots, positions).double().view(B, H, D)
    keys, values = k[slots].transpose(-1, -2), v[slots]  # [B, KV, L, D]
    mask = torch.where(torch.arange(L)[None, :] <= positions, 0.0, float("-inf"))[:, None, None]  # [B, 1, 1, L]
    ref = attend(q.transpose(1, 2).double(), keys.double(), values.double(), mask.double())[:, :, 0]
    theirs = attend(q.transpose(1, 2), keys, values, mask.bfloat16())[:, :, 0].double()
    bound = BF16_STEP * ref.abs() + 1e-3
    assert ((got - ref).abs() <= bound).all()
    assert ((theirs - ref).abs() > bound).any()
    assert (got - ref).abs().mean() <= (theirs - ref).abs().mean()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_gets_the_same_bits_in_any_batch(dtype):
    """What keeps greedy speculation token-identical to plain decoding: a token's norm, rotary and attention do not
    depend on the other rows of the forward. The same token (slot 1, position 20) is computed alone as a decode
    step (B=1, T=1) and as the third of four verified positions among two other sequences (B=3, T=4): bitwise
    equal outputs and stored keys/values."""
    torch.manual_seed(0)
    H, KV, D, L = 4, 2, 32, 64
    cache = torch.randn(3, KV, D, L).to(dtype), torch.randn(3, KV, L, D).to(dtype)  # one layer, 3 slots
    big = (cache[0].clone(), cache[1].clone())
    qkv = torch.randn(3, 4, (H + 2 * KV) * D).to(dtype)
    cos, sin = torch.randn(3, 1, 4, D).to(dtype), torch.randn(3, 1, 4, D).to(dtype)
    norm_w = torch.rand(D).to(dtype) + 0.5
    slots, positions = torch.tensor([0, 1, 2]), torch.tensor([[3, 4, 5, 6], [18, 19, 20, 21], [40, 41, 42, 43]])
    with torch.inference_mode():
        q_big = kernels.rope_store(qkv, cos, sin, norm_w, norm_w, 1e-6, *big, slots, positions, H, KV)
        out_big = kernels.attention(q_big, *big, slots, positions)
        small = (cache[0].clone(), cache[1].clone())
        # The alone run sees the cache as the big run left it for positions < 20 of slot 1 (its earlier tokens).
        small[0][1, :, :, 18:20] = big[0][1, :, :, 18:20]
        small[1][1, :, 18:20] = big[1][1, :, 18:20]
        one = (slice(1, 2), slice(2, 3))
        q_one = kernels.rope_store(qkv[one], cos[1:2, :, 2:3], sin[1:2, :, 2:3], norm_w, norm_w, 1e-6, *small,
                                   torch.tensor([1]), torch.tensor([[20]]), H, KV)
        out_one = kernels.attention(q_one, *small, torch.tensor([1]), torch.tensor([[20]]))
        rows = kernels.rms_norm(qkv, norm_w.repeat(qkv.shape[-1] // D), 1e-6)
        row = kernels.rms_norm(qkv[one], norm_w.repeat(qkv.shape[-1] // D), 1e-6)
    assert torch.equal(q_one[0, 0], q_big[1, 2])
    assert torch.equal(out_one[0, 0], out_big[1, 2])
    assert torch.equal(small[0][1, :, :, 20], big[0][1, :, :, 20]) and torch.equal(small[1][1, :, 20], big[1][1, :, 20])
    assert torch.equal(row[0, 0], rows[1, 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64])
def test_attention_of_each_query_is_the_same_alone_or_paired(dtype, head_dim):
    """The attention kernel works on pairs of query rows that share a KV head (3 query heads over 1 here, so a pair
    can join two tokens of a verify, whose key counts differ) and on 32 keys / 32 channels at a time in vector
    registers, with scalar code for the rest (head_dim 40: 32 channels in registers, 8 not). Every query of a
    B = 3, T = 4 batch, its key counts straddling the 32-key blocks (30-33, 62-65, 1-4 keys), is computed again
    alone (B = 1, T = 1, where it is paired with another head or with none) and must come out bitwise equal."""
    torch.manual_seed(0)
    H, KV, L = 3, 1, 72
    k, v = torch.randn(3, KV, head_dim, L).to(dtype), torch.randn(3, KV, L, head_dim).to(dtype)
    q = torch.randn(3, 4, H, head_dim).to(dtype)
    slots, positions = torch.tensor([2, 0, 1]), torch.tensor([[29, 30, 31, 32], [61, 62, 63, 64], [0, 1, 2, 3]])
    with torch.inference_mode():
        batch = kernels.attention(q, k, v, slots, positions)
        for b in range(3):
            for t in range(4):
                one = (slice(b, b + 1), slice(t, t + 1))
                alone = kernels.attention(q[one], k, v, slots[b : b + 1], positions[one])
                assert torch.equal(alone[0, 0], batch[b, t]), (b, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [101, 161])
def test_linear_matches_float64_and_each_row_is_computed_alone(dtype, N):
    """The kernels' `linear` for every row count it serves (1..KERNEL_ROWS, and 32 / 33 / 41 rows, which the fused
    layers of small models give it) against a float64 reference, and each row's outputs bitwise the same whatever
    batch it is in: the row counts go through different tiles (4 rows x 2 weight rows, 2 x 2, 1 x 1 or 1 x 2, 1 x 8
    for a single fp32 row, and from 32 rows on a cache-resident weight 2 x 6 and 1 x 6, ending in pairs), which
    must all sum in the one order. N = 101 splits the rows between the threads, N = 161 the weight rows; an odd
    output count (the last weight row outside the pairs) and a bias are included.
    Tolerance: inputs ~1 and weights ~0.05 over K = 192 give products summing to ~0.7, plus a bias ~1; fp32
    accumulation of 192 such terms errs by well under 1e-5 absolute. bf16 adds one rounding of the output, at most
    half a bf16 step: 2^-8 of |y|. A wrong row, weight row or a missing bias misses by ~0.1 or more."""
    torch.manual_seed(0)
    K = 192
    w = (torch.randn(N, K) * 0.05).to(dtype)
    bias = torch.randn(N).to(dtype)
    counts = [*range(1, packed.KERNEL_ROWS[dtype] + 1), 32, 33, 41]
    x = torch.randn(max(counts), K).to(dtype)
    rel = 0.0 if dtype == torch.float32 else 2.0**-8
    with torch.inference_mode():
        alone = [kernels.linear(x[i:i + 1], w, bias) for i in range(len(x))]
        for rows in counts:
            y = kernels.linear(x[:rows], w, bias)
            ref = x[:rows].double() @ w.double().T + bias.double()
            assert ((y.double() - ref).abs() <= rel * ref.abs() + 1e-5).all()
            for i in range(rows):
                assert torch.equal(y[i], alone[i][0]), (rows, i)


def test_linear_rejects_what_it_cannot_compute_and_the_packs_route_around_it(monkeypatch):
    """`linear` needs the input size a multiple of 8 (its 8-lane sums) and one dtype: a clear error, not garbage.
    The packed linears send inputs of up to `kernel_rows` rows to it and no others, and a layer whose input size
    is not a multiple of 8 never reaches it (oneDNN / MKL take it, to the packed tests' tolerance)."""
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="multiple of 8"):
            kernels.linear(torch.ones(1, 12), torch.ones(3, 12), None)
        with pytest.raises(RuntimeError, match="share a dtype"):
            kernels.linear(torch.ones(1, 16), torch.ones(3, 16).bfloat16(), None)
    calls = []
    saved = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *args: calls.append(args[0].shape[0]) or saved(*args))
    torch.manual_seed(0)
    layer, odd = torch.nn.Linear(64, 40), torch.nn.Linear(12, 40)
    limit = packed.kernel_rows((layer,))  # KERNEL_ROWS, or more for a weight this small (SMALL_OUTPUT)
    with torch.inference_mode():
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(packed.linears(x, layer)[0], layer(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(3, 12)
        torch.testing.assert_close(packed.linears(x, odd)[0], odd(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, limit]


def test_bad_indices_fail_before_any_write():
    """A slot or position outside the cache is an error, and the cache is untouched (nothing written past it)."""
    k, v = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 16, 8)
    qkv, cs = torch.ones(1, 2, 3 * 8), torch.ones(1, 1, 2, 8)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="position 16 is outside the cache"):
            kernels.rope_store(qkv, cs, cs, None, None, 0.0, k, v, torch.tensor([1]), torch.tensor([[15, 16]]), 1, 1)
        with pytest.raises(RuntimeError, match="slot 2 is outside the cache"):
            kernels.attention(torch.ones(1, 1, 1, 8), k, v, torch.tensor([2]), torch.tensor([[0]]))
        with pytest.raises(RuntimeError, match="kv_heads"):
            kernels.rope_store(qkv, cs, cs, None, None, 0.0, k, v, torch.tensor([1]), torch.tensor([[0, 1]]), 1, 2)
    assert not k.any() and not v.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,bias", [(False, True), (True, False)])
def test_a_whole_layer_in_one_call_is_the_modules_kernels_bit_for_bit(dtype, qk_norm, bias, monkeypatch):
    """`kernels.decoder_layer` runs the kernels the layer's modules would call, in their order, so the layer's
    output and the keys and values it stores are bitwise those of the modules' own (kernel) forwards, with and
    without per-head norms (Qwen3 / Llama) and projection biases (Qwen2-style), in fp32 and bf16. The fused path
    is taken exactly once per layer call."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("tiny-qwen3"), qk_norm=qk_norm, attention_bias=bias)
    model = CausalLM(cfg).to(dtype).eval()
    model.reset_parameters(std=0.15)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not the init's zeros / ones, which would hide a dropped bias or norm
    layer = model.model.layers[1]
    caches = [KVCache(cfg.num_hidden_layers, 3, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
              for _ in range(2)]
    torch.manual_seed(1)
    caches[0].k.normal_()
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    x = torch.randn(2, 3, cfg.hidden_size).to(dtype)
    positions = torch.tensor([[5], [17]]) + torch.arange(3)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    calls = []
    saved = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a: calls.append(1) or saved(*a))
    with torch.inference_mode():
        fused = layer(x, cos, sin, caches[0].view([2, 0], [5, 17], 3))
        monkeypatch.setattr(DecoderLayer, "one_kernel", lambda self, x: False)
        modules = layer(x, cos, sin, caches[1].view([2, 0], [5, 17], 3))
    assert calls == [1]
    assert torch.equal(fused, modules)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_mtp_depth_in_one_call_is_its_modules_kernels_bit_for_bit(dtype, monkeypatch):
    """`kernels.mtp_layer` runs the kernels an MTP depth's modules call (its norms, the [embedding, hidden]
    projection, its decoder layer, its final norm), so at row counts where each module takes the kernels (a
    chained round of 2 sequences, a catch-up of 2 x 3 positions) its state and the keys and values it stores are
    bitwise those of the modules' path, in fp32 and bf16, and the depth takes it exactly once per call. Norm
    weights and the hidden state are not the init's ones, so a swapped or dropped norm would show."""
    torch.manual_seed(0)
    cfg = preset("tiny-qwen3")
    head = MTP(cfg, MTPConfig(num_layers=1)).to(dtype).eval()
    head.reset_parameters(std=0.15)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    depth = head.layers[0]
    calls = []
    saved = kernels.mtp_layer
    monkeypatch.setattr(kernels, "mtp_layer", lambda *a: calls.append(1) or saved(*a))
    for T in (1, 3):
        torch.manual_seed(T)
        hidden, embeds = (torch.randn(2, T, cfg.hidden_size).to(dtype) for _ in range(2))
        positions = torch.tensor([[5], [17]]) + torch.arange(T)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        caches = [KVCache(1, 3, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                          first_layer=cfg.num_hidden_layers) for _ in range(2)]
        outs = []
        for cache, fused in zip(caches, (True, False)):
            with monkeypatch.context() as m, torch.inference_mode():
                if not fused:
                    m.setattr(MTPLayer, "one_kernel", lambda self, x: False)
                outs.append(depth(hidden, embeds, cos, sin, cache.view([2, 0], [5, 17], T)))
        assert torch.equal(outs[0], outs[1]), T
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        assert caches[0].k.abs().sum() > 0
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_mtp_drafting_in_one_call_drafts_and_stores_what_its_rounds_do(dtype):
    """`MTP.draft` (one `kernels.mtp_draft` call) against the rounds it replaces, each through the modules: the
    depth over every catch-up row (2 sequences, 1 and 4 rows, the second ragged: its last row is its second), the
    head's argmax on each sequence's last row, then 3 rounds of the depth on its own state and draft at the next
    position. Drafts and every key and value stored (catch-up rows, padding included, and chained positions) are
    bitwise equal in fp32 and bf16. A head of std 0.15 makes drafts that differ from round to round, so a wrong
    position, row or embedding shows in the tokens or in the cache."""
    torch.manual_seed(0)
    cfg = preset("tiny-qwen3")
    target = CausalLM(cfg).to(dtype).eval()
    head = MTP(cfg, MTPConfig(num_layers=1)).to(dtype).eval()
    head.reset_parameters(std=0.15)
    rounds = 4
    for T, last in ((1, [0, 0]), (4, [3, 1])):
        torch.manual_seed(T)
        hidden = torch.randn(2, T, cfg.hidden_size).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (2, T))
        caches = [KVCache(1, 3, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                          first_layer=cfg.num_hidden_layers) for _ in range(2)]
        with torch.inference_mode():
            view = caches[0].view([2, 0], [5, 17], T)
            got = head.draft(hidden, ids, torch.tensor(last), rounds, target.lm_head, target.model.embed_tokens.weight,
                             view)
            view = caches[1].view([2, 0], [5, 17], T)
            state = head.state(hidden, ids, view.positions, target.embed, view)[[0, 1], last]
            want = []
            for r in range(rounds):
                want.append(head.logits(state, target.lm_head).argmax(-1))
                if r + 1 < rounds:
                    one = caches[1].view([2, 0], [5 + last[0] + r + 1, 17 + last[1] + r + 1], 1)
                    state = head.state(state[:, None], want[-1][:, None], one.positions, target.embed, one)[:, 0]
        assert got is not None and torch.equal(got, torch.stack(want, 1)), T
        assert len(set(got.flatten().tolist())) > 2
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v), T


@pytest.mark.parametrize("V, top_k", [(64, 0), (64, 10), (3000, 0)])
def test_verify_coupled_gives_the_verdict_and_log_probs_of_its_torch_twin(V, top_k):
    """The fused verifier against `verify_coupled` and the engine's gather, on 3000 random sequences with k = 3,
    draft lengths 0-3, drafts mostly the target's argmax (so every acceptance count occurs), logits of scale 3,
    with and without top-k (-inf log-probs, which must get exactly zero mass) and at a vocabulary large enough that
    sequences are split between threads. Where the two differ, it must be a draw within rounding: the kernel's e^x
    is within 2 ulp of torch's, so the inverse CDF's target must lie within 1e-5 of the total of a CDF boundary
    (2 ulp of p over a few thousand terms). Elsewhere: the same count, token and log-probs bit for bit. It fails on
    an off-by-one in the count, a token drawn from the wrong row or with the wrong uniform, or a masked token drawn."""
    assert kernels.loaded()
    g = torch.Generator().manual_seed(V + top_k)
    B, k = 3000, 3
    lp = processed_logprobs(torch.randn(B, k + 1, V, generator=g) * 3, 1.0, top_k)
    best = lp[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, best, torch.randint(0, V, (B, k), generator=g))
    draft_len, u = torch.randint(0, k + 1, (B,), generator=g), torch.rand(B, k + 1, generator=g)
    with torch.inference_mode():
        n, nxt, lps = kernels.verify_coupled(lp, drafts, draft_len, u)
    ref = verify_coupled(lp.exp(), drafts, draft_len, u)
    ref_lps = emitted_logprobs(lp, drafts, ref)
    assert sorted(set(n.tolist())) == [0, 1, 2, 3]
    assert torch.isfinite(lps.gather(1, n[:, None])).all()  # no masked token drawn
    p = lp.exp()
    agree = (n == ref.num_accepted) & (nxt == ref.next_token)
    for b in torch.nonzero(~agree).squeeze(-1).tolist():
        j = min(int(n[b]), int(ref.num_accepted[b]))  # the first position the two drew differently
        drawn = [int(nxt[b]) if j == n[b] else int(drafts[b, j]), int(ref.next_token[b]) if j == ref.num_accepted[b]
                 else int(drafts[b, j])]
        cdf = p[b, j].double().cumsum(0)
        boundary = cdf[min(drawn)]
        assert abs(float(u[b, j]) * float(cdf[-1]) - float(boundary)) < 1e-5 * float(cdf[-1])
    assert agree.float().mean() > 0.99
    emitted = torch.arange(k + 1)[None] <= n[:, None]
    assert torch.equal(lps[agree & emitted.any(1)][emitted[agree]], ref_lps[agree][emitted[agree]])
    assert (lps[~emitted] == 0).all()


def test_verify_coupled_draws_each_position_as_a_plain_step_does():
    """The engine's plain step is this kernel with no drafts; a verify step must draw every position's token by
    the same arithmetic, or speculation would change a seed's tokens. On 2000 sequences with k = 4: each emitted
    token equals, bit for bit, the kernel's k = 0 draw from that position's row with that position's uniform, and
    the count stops at the first draft that differs from it (drafts: that draw 70 % of the time)."""
    assert kernels.loaded()
    g = torch.Generator().manual_seed(5)
    B, k, V = 2000, 4, 500
    lp = processed_logprobs(torch.randn(B, k + 1, V, generator=g) * 2, 1.0, 40)
    u = torch.rand(B, k + 1, generator=g)
    none, zero = torch.empty(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    with torch.inference_mode():
        plain = [kernels.verify_coupled(lp[:, j : j + 1].contiguous(), none, zero, u[:, j : j + 1]) for j in range(k + 1)]
        drawn = torch.stack([t for _, t, _ in plain], 1)
        other = (drawn[:, :k] + torch.randint(1, V, (B, k), generator=g)) % V
        drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, drawn[:, :k], other)
        n, nxt, lps = kernels.verify_coupled(lp, drafts, torch.full((B,), k), u)
    stop = torch.where(drafts != drawn[:, :k], torch.arange(k), k).min(1).values
    assert torch.equal(n, stop) and torch.equal(nxt, drawn.gather(1, n[:, None]).squeeze(1))
    plain_lps = torch.cat([l for _, _, l in plain], 1)
    emitted = torch.arange(k + 1)[None] <= n[:, None]
    assert torch.equal(lps[emitted], plain_lps[emitted])
    assert len(set(n.tolist())) == k + 1


def test_verify_coupled_rejects_bad_drafts_before_any_work():
    assert kernels.loaded()
    lp = processed_logprobs(torch.randn(2, 3, 10), 1.0)
    u = torch.rand(2, 3)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            kernels.verify_coupled(lp, torch.tensor([[1, 10], [0, 0]]), torch.tensor([2, 0]), u)
        with pytest.raises(RuntimeError, match=r"outside \[0, k\]"):
            kernels.verify_coupled(lp, torch.tensor([[1, 2], [0, 0]]), torch.tensor([3, 0]), u)
        with pytest.raises(RuntimeError, match=r"uniforms \[B, k \+ 1\]"):
            kernels.verify_coupled(lp, torch.tensor([[1, 2], [0, 0]]), torch.tensor([2, 0]), u[:, :2])
        # a padded draft past its sequence's length is never read, whatever it holds
        n, _, _ = kernels.verify_coupled(lp, torch.tensor([[1, -5], [99, 99]]), torch.tensor([1, 0]), u)
        assert n.tolist()[1] == 0


def test_the_fused_layer_sees_every_change_of_its_weights(monkeypatch):
    """`DecoderLayer.fused` reads weights it looked up once per change of the layer's parameters (`FusedPlan`).
    After an in-place update (what an optimizer step or a refit's `copy_` does), after re-assigning a parameter
    (`module.weight = p`) and after `load_state_dict(..., assign=True)`, the fused layer computes what its modules
    compute from the new weights, bit for bit, as it does before any change; each change moves the output, so a
    plan that missed one (old packs) would differ by O(1), not by rounding."""
    torch.manual_seed(0)
    cfg = preset("tiny-qwen3")
    model = CausalLM(cfg).eval()
    model.reset_parameters(std=0.15)
    layer = model.model.layers[0]
    torch.manual_seed(1)
    x = torch.randn(2, 3, cfg.hidden_size)
    positions = torch.tensor([[5], [17]]) + torch.arange(3)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float32)

    def forward(fused: bool) -> torch.Tensor:
        cache = KVCache(cfg.num_hidden_layers, 3, 64, cfg.num_key_value_heads, cfg.head_dim)
        with monkeypatch.context() as m, torch.inference_mode():
            if not fused:
                m.setattr(DecoderLayer, "one_kernel", lambda self, x: False)
            return layer(x, cos, sin, cache.view([2, 0], [5, 17], 3))

    def in_place():
        with torch.no_grad():
            layer.mlp.up_proj.weight.mul_(1.5)  # one of a concatenated pair: its pack is a copy

    def reassigned():
        layer.mlp.down_proj.weight = torch.nn.Parameter(2 * layer.mlp.down_proj.weight.detach())

    def loaded():
        layer.load_state_dict({name: 0.5 * t for name, t in layer.state_dict().items()}, assign=True)

    before = forward(True)
    assert torch.equal(before, forward(False))
    for change in (in_place, reassigned, loaded):
        change()
        after = forward(True)
        assert torch.equal(after, forward(False)), change.__name__
        assert (after - before).abs().max() > 0.1, change.__name__
        before = after


def test_a_generate_call_checks_each_plan_once_and_the_next_call_sees_new_weights(monkeypatch):
    """Inside `generate` (a `decoder.weights_fixed` block) a layer's plan is checked against its parameters on its
    first forward only: with 12 forwards of 4 layers, `params_key` runs 4 times, not 48. Weights changed between two
    calls (a refit's in-place `copy_`) reach the next call: its log-probs are a fresh engine's on a copy of the
    changed model, bit for bit; with plans never checked again the second call would compute with the old packed copies,
    whose log-probs differ by O(0.1) (the change scales every MLP weight by 1.5)."""
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3")).eval()
    model.reset_parameters(std=0.15)
    prompts, params = [[1, 5, 9, 2], [7, 7, 3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = LLMEngine(model, max_num_seqs=2)
    checks = []
    real_key = decoder.params_key
    monkeypatch.setattr(decoder, "params_key", lambda p: checks.append(1) or real_key(p))
    before = engine.generate(prompts, params)
    assert len(checks) == model.config.num_hidden_layers
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.copy_(1.5 * layer.mlp.up_proj.weight)
    after = engine.generate(prompts, params)
    fresh = LLMEngine(copy.deepcopy(model), max_num_seqs=2).generate(prompts, params)  # new modules, new plans
    assert [a.logprobs for a in after] == [f.logprobs for f in fresh]
    assert max(abs(a - b) for x, y in zip(after, before) for a, b in zip(x.logprobs, y.logprobs)) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_small_layer_fuses_past_the_linears_row_bound_and_each_token_keeps_its_bits(dtype, monkeypatch):
    """A small layer (tiny-qwen3: 197 K multiply-adds a row) takes the fused path up to FUSED_LAYER_MACS' worth of
    rows (170), past the kernels' linear's own bound (16 fp32 / 32 bf16), while SmolLM2's layers keep that bound.
    A decode of 64 sequences is one kernel call a layer, and each sequence's output is bitwise what it gets decoded
    alone (the kernels compute each row alone); against the modules' path, which takes oneDNN's GEMMs at 64 rows,
    it agrees to rounding. Tolerance: each sum has up to 384 terms of |w x| ~ 0.15, so |terms| add to ~60 and a
    reordered fp32 sum differs by ~60 x 6e-8 ~ 4e-6; the layer's later projections scale that by their gain (~3
    each, std 0.15 x sqrt(384)), so up to ~1e-4 (seen: 1.5e-5). bf16 outputs differ by up to a bf16 step of |y| ~ 4
    (2^-6). A dropped weight, bias or row misses by O(0.1-1)."""
    torch.manual_seed(0)
    cfg = preset("tiny-qwen3")
    layer = CausalLM(cfg).to(dtype).eval().model.layers[0]
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    macs = sum(m.in_features * m.out_features for group in layer.projections() for m in group)
    assert layer.plan().max_rows == decoder.FUSED_LAYER_MACS // macs == 170 > packed.KERNEL_ROWS[dtype]
    smol = dataclasses.replace(cfg, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64)
    assert decoder.fused_rows(DecoderLayer(smol, 0).to(dtype).projections()) == packed.KERNEL_ROWS[dtype]

    B = 64
    torch.manual_seed(1)
    x = torch.randn(B, 1, cfg.hidden_size).to(dtype)
    starts = [3 + b % 7 for b in range(B)]
    cos, sin = rope_cos_sin(torch.tensor(starts)[:, None], cfg.head_dim, cfg.rope_theta, dtype)
    calls = []
    saved = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a: calls.append(a[0].shape[0]) or saved(*a))

    def forward(rows: slice) -> torch.Tensor:
        cache = KVCache(cfg.num_hidden_layers, B, 32, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
        torch.manual_seed(2)
        cache.k.normal_()
        cache.v.normal_()
        with torch.inference_mode():
            return layer(x[rows], cos[rows], sin[rows], cache.view(list(range(B))[rows], starts[rows], 1))

    batch = forward(slice(None))
    assert calls == [B]
    for b in (0, 17, 63):
        assert torch.equal(forward(slice(b, b + 1))[0], batch[b])
    monkeypatch.setattr(DecoderLayer, "one_kernel", lambda self, x: False)
    modules = forward(slice(None))
    tol = 1e-4 if dtype == torch.float32 else 2.0**-6
    torch.testing.assert_close(batch.float(), modules.float(), rtol=tol, atol=tol)


def test_a_layer_off_the_cpu_gets_a_plan_that_packs_nothing(monkeypatch):
    """The fused kernel and the packs (oneDNN's weight reorder) are CPU-only: a layer whose weights live elsewhere
    (the GPU tier's CUDA models; here the meta device, which needs no GPU) must get a plan that never fuses and
    never packs. A plan that packed anyway called oneDNN on CUDA weights and failed every engine forward there;
    without the device check this test fails twice over (a pack is made, and max_rows is the kernel bound)."""
    def no_pack(group):
        raise AssertionError("packed a layer off the CPU")

    monkeypatch.setattr(decoder, "packed", no_pack)
    layer = DecoderLayer(preset("tiny-qwen3"), 0).to("meta")
    plan = layer.plan()
    assert plan.max_rows == 0 and plan.weights == ()
    with torch.inference_mode():
        assert not layer.one_kernel(torch.empty(1, 1, layer.self_attn.q_proj.in_features, device="meta"))


def test_engine_takes_the_kernels_and_decodes_as_torch_does(tiny_model):
    """The engine's forwards (prefill, decode) go through the kernels: every layer of every forward is one
    `decoder_layer` call (all of them have at most KERNEL_ROWS rows). Greedy tokens equal torch's path, and the completions' log-probs agree to 1e-4 (the tiny model's
    logits are O(10): fp32 differences of ~1e-6 per layer stay far below that, and the peaked distributions leave
    no near-tie for them to flip)."""
    calls = []
    saved = kernels.decoder_layer
    kernels.decoder_layer = lambda *args: calls.append(1) or saved(*args)
    try:
        prompts = [[1, 5, 9, 2], [7, 7, 3]]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        fused = LLMEngine(tiny_model, max_num_seqs=2).generate(prompts, params)
    finally:
        kernels.decoder_layer = saved
    # one prefill + 11 decode forwards (the 12th token comes from the 11th decode's logits), 4 layers each
    assert len(calls) == 12 * tiny_model.config.num_hidden_layers
    plain = eager(lambda: LLMEngine(tiny_model, max_num_seqs=2).generate(prompts, params))
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_a_failed_build_warns_and_falls_back_or_errors_when_required(tmp_path, monkeypatch):
    """No compiler: the build raises with the compiler's command and leaves no library (not even a partial one) in
    the cache; `loaded()` then warns and returns False, or raises under MEGATRON_SPEC_KERNELS=1, and =0 never
    tries to build."""
    monkeypatch.setenv("MEGATRON_SPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false .* failed"):
        kernels.build()
    assert not list((tmp_path / "kernels").glob("*.so*"))
    monkeypatch.setenv("MEGATRON_SPEC_KERNELS", "auto")
    with pytest.warns(UserWarning, match="CPU kernels unavailable"):
        assert kernels.loaded.__wrapped__() is False
    monkeypatch.setenv("MEGATRON_SPEC_KERNELS", "1")
    with pytest.raises(RuntimeError, match="MEGATRON_SPEC_KERNELS=1"):
        kernels.loaded.__wrapped__()
    monkeypatch.setenv("MEGATRON_SPEC_KERNELS", "0")
    monkeypatch.setattr(kernels, "build", lambda: pytest.fail("built although turned off"))
    assert kernels.loaded.__wrapped__() is False


def test_torch_compile_traces_torchs_ops_not_the_kernels():
    """vLLM's compiled mode traces our drafter heads with torch.compile: the kernels have no fake-tensor
    implementation, so tracing must take torch's ops (fullgraph: any graph break or kernel call would fail here).
    The result is torch's, bit for bit."""
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        compiled = torch.compile(norm, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager(norm, x), rtol=0, atol=0)
