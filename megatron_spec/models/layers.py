"""Building blocks of the decoder: RMSNorm, rotary embedding, attention, SwiGLU MLP and the MoE MLP.

Parameter names follow HF transformers' on-disk layout (`q_proj`, `gate_proj`, `experts.{e}.up_proj`, ...) so a
state dict loads from and saves to HF safetensors without a rename table. No distributed code lives here.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from .config import ModelConfig
from .kv_cache import BatchView
from .masks import causal_mask
from .packed import linears, packable, packed_linear


class AttentionCache(Protocol):
    """What attention needs from a KV cache (the engine's `KVCache` batch views implement it).

    `update` stores this step's keys/values for `layer` and returns all keys/values the step's queries may attend
    to, plus the additive or boolean attention mask for them. A cache whose mask has a shape worth exploiting may
    instead attend itself: `attention(layer, q, k, v)` -> the attention's output [B, H, T, D] (drafter training's
    unrolled steps, `drafter_loss.UnrolledAttention`).
    """

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if kernels.usable(x) and self.weight.dtype == x.dtype:
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 (bf16 squares lose too much), then scale in the input dtype, as HF does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of the rotary angles for `positions` [B, T] -> two [B, 1, T, head_dim] tensors.

    Computed per forward from the positions (a [B, T, head_dim/2] outer product) instead of a table, so any
    position up to the context works; only the inverse frequencies are kept between calls (`inverse_frequencies`).
    """
    angles = positions.float()[..., None] * inverse_frequencies(head_dim, theta, positions.device)
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype, cache: AttentionCache | None
           ) -> tuple[Tensor, Tensor]:
    """`rope_cos_sin`, read from `rope_table` where the forward runs through the engine's KV cache (a `BatchView`,
    whose positions are below the cache's length): two row gathers instead of eight ops. A drafting round of the
    main job's tiny MTP head at B=4 spent ~26 us of its ~340 us here."""
    if not isinstance(cache, BatchView):
        return rope_cos_sin(positions, head_dim, theta, dtype)
    cos, sin = rope_table(head_dim, theta, dtype, positions.device, cache.cache.max_len)
    B, T = positions.shape
    rows = positions.reshape(-1)
    return cos.index_select(0, rows).view(B, 1, T, head_dim), sin.index_select(0, rows).view(B, 1, T, head_dim)


@functools.lru_cache(maxsize=8)
def rope_table(head_dim: int, theta: float, dtype: torch.dtype, device: torch.device, length: int
               ) -> tuple[Tensor, Tensor]:
    """cos / sin [length, head_dim] of positions 0..length-1, by `rope_cos_sin` itself: the same products and the
    same cos / sin. torch computes the last (numel mod 16) elements of a tensor with scalar cos / sin, which may
    differ from the vectorised ones by an ulp, so with head_dim a multiple of 16 (every shipped model) a row has the
    same bits as computed per forward (`tests/models/test_rotary.py`); otherwise the table is at least the same
    whatever the batch's shape, which per-forward values were not."""
    cos, sin = rope_cos_sin(torch.arange(length, device=device)[None], head_dim, theta, dtype)
    return cos.view(length, head_dim), sin.view(length, head_dim)


@functools.lru_cache(maxsize=64)
def inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2, made once per model shape and device rather than in four small
    ops on every forward (the trunk's and each drafting round's). Made outside inference mode, so the trainer's
    forwards may read it too."""
    with torch.inference_mode(False):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        return 1.0 / (theta**exponents)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache | None) -> Tensor:
        B, T, _ = x.shape
        qkv = self.kernel_qkv(x, cache)
        if qkv is not None:
            # The engine's forwards: two fused kernels do the norms, rotary, cache store and attention below.
            out = cache.attend(self.layer, qkv, cos, sin, self.q_norm, self.k_norm, self.n_heads)
            return linears(out, self.o_proj)[0]
        q, k, v = self.rotated(x, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.n_kv != self.n_heads)
        elif hasattr(cache, "attention"):
            out = cache.attention(self.layer, q, k, v)
        else:
            k, v, mask = cache.update(self.layer, k, v)
            out = attend(q, k, v, mask)
        return linears(out.transpose(1, 2).reshape(B, T, -1), self.o_proj)[0]

    def store(self, x: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache) -> None:
        """Only what `forward` writes into `cache` for `x`'s positions (their keys and values), for positions whose
        outputs nobody reads: a drafter catching up reads its state at each sequence's last position only."""
        qkv = self.kernel_qkv(x, cache)
        if qkv is not None:
            cache.store(self.layer, qkv, cos, sin, self.q_norm, self.k_norm, self.n_heads)
        else:
            cache.update(self.layer, *self.rotated(x, cos, sin)[1:])

    def kernel_qkv(self, x: Tensor, cache: AttentionCache | None) -> Tensor | None:
        """The q/k/v projections [B, T, (heads + 2 kv_heads) head_dim] in one packed GEMM, where the engine's CPU
        kernels do the rest (per-head norms, rotary, cache store: `BatchView.attend` / `store`); None elsewhere."""
        qkv_proj = (self.q_proj, self.k_proj, self.v_proj)
        if isinstance(cache, BatchView) and kernels.usable(x) and packable(x, qkv_proj):
            return packed_linear(x, qkv_proj)
        return None

    def rotated(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, heads, T, head_dim], k and v [B, kv_heads, T, head_dim] with torch's ops: projected, q and k
        normed per head (Qwen3) and rotated."""
        B, T, _ = x.shape
        q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention of q [B, H, T, D] over k, v [B, KV, L, D] with a mask [B, 1, T, L], boolean (True:
    may attend) or additive (0 / -inf in the scores' dtype, what the engine's KV cache gives).

    Written out rather than calling SDPA: for the short query blocks of decoding and verification (T = 1..k+1)
    torch's CPU flash kernel costs milliseconds per call in set-up, this costs tens of microseconds. The query
    heads that share a KV head are stacked along the time axis so one matmul serves the group.
    """
    B, H, T, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    group = H // KV
    scores = (q.reshape(B, KV, group * T, D) @ k.transpose(-1, -2)).mul_(D**-0.5).view(B, KV, group, T, L)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    else:
        scores.add_(mask[:, :, None])
    probs = scores.float().softmax(-1).to(q.dtype).view(B, KV, group * T, L)
    return (probs @ v).view(B, H, T, D)


def attend_unrolled(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Attention of q [B, H, n, D] over the keys / values of unrolled steps ([B, KV, >= n, D] each, the first n
    rows read): causal over step 0's, and over each later step's on the diagonal only (row t sees row t).

    `attend` with the mask [causal | eye | eye ...] gives the same up to rounding (`tests/models/test_attention.py`),
    but scores all (s + 1) n keys of a step s, of which a row sees at most n + s: here each later step's scores
    are one dot product a row (an update of the main job's MTP head on its three chained drafts is 1.1-1.2x faster
    this way, more for longer rows)."""
    B, H, n, D = q.shape
    KV = keys[0].shape[1]
    group, scale = H // KV, D**-0.5
    scores = (q.reshape(B, KV, group * n, D) @ keys[0][:, :, :n].transpose(-1, -2)).mul_(scale)
    scores = scores.view(B, KV, group, n, n).masked_fill(~causal_mask(n, q.device)[:, :, None], float("-inf"))
    heads = q.reshape(B, KV, group, n, D)
    diagonal = [(heads * k[:, :, None, :n]).sum(-1, keepdim=True).mul_(scale) for k in keys[1:]]
    probs = torch.cat([scores, *diagonal], -1).float().softmax(-1).to(q.dtype)
    out = (probs[..., :n].reshape(B, KV, group * n, n) @ values[0][:, :, :n]).view(B, KV, group, n, D)
    for j, v in enumerate(values[1:]):
        out = out + probs[..., n + j, None] * v[:, :, None, :n]
    return out.reshape(B, H, n, D)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if kernels.usable(x) and packable(x, (self.gate_proj, self.up_proj)):
            return linears(kernels.silu_mul(packed_linear(x, (self.gate_proj, self.up_proj))), self.down_proj)[0]
        gate, up = linears(x, self.gate_proj, self.up_proj)
        return linears(F.silu(gate) * up, self.down_proj)[0]


class MoE(nn.Module):
    """Qwen3-MoE sparse MLP: softmax router, top-k experts, optional renormalisation of the top-k weights.

    After each forward `self.aux_loss` holds the Switch-style load-balancing loss
    E * sum_e f_e * P_e (f_e: share of top-k assignments that went to expert e, P_e: mean router probability of e),
    which is 1.0 for a perfectly balanced router. Training adds `router_aux_loss_coef * aux_loss`.

    Routing replay (`routing.py`): after each forward `self.chosen` holds the experts each input row was routed to
    [rows, top_k]; where `self.replay` is set, rows route to its experts instead (a row of -1: to its own top-k),
    weighted by this router's probabilities of those experts, so the gradient still reaches the router.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.aux_loss: Tensor | None = None
        self.chosen: Tensor | None = None
        self.replay: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.replay is not None:
            chosen = torch.where(self.replay < 0, chosen, self.replay)
            weights = probs.gather(1, chosen)
        self.chosen = chosen
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)

        out = torch.zeros_like(x)
        # Loop over the experts that received tokens: each runs once on the rows routed to it.
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])

        n_experts = probs.shape[-1]
        assigned = F.one_hot(chosen, n_experts).float().sum(1).mean(0) / self.top_k
        self.aux_loss = n_experts * (assigned * probs.mean(0)).sum()
        return out.view(shape)
