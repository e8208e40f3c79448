"""What one forward pass of a network costs, in parameters, bytes and FLOPs, before any hardware is involved.

`CostShape` condenses a `ModelConfig` (target or drafter) into the handful of numbers the roofline needs:

- weights every forward reads whatever the batch (attention projections, dense MLPs, router, LM head);
- MoE experts, read only when a token in the batch is routed to them (see `experts_touched`);
- KV-cache bytes per token of context, and attention FLOPs per (query token x context token).

Norms, biases and RoPE are left out: they are well under 0.1 % of the bytes and FLOPs of every preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.drafters.registry import sim_drafter
from megatron_spec.models.config import ModelConfig


@dataclass(frozen=True)
class CostShape:
    name: str
    """Human-readable name (preset or drafter kind)."""
    layers: int
    """Decoder layers; each adds two tensor-parallel all-reduces per forward."""
    hidden: int
    """Residual width: the size of activations that collectives move per token."""
    dense_params: float
    """Parameters every forward reads regardless of batch size (attention, dense MLPs, routers, LM head)."""
    moe_layers: int
    """Layers whose MLP is a mixture of experts."""
    experts: int
    """Routed experts per MoE layer (0 for dense models)."""
    top_k: int
    """Experts per token."""
    expert_params: float
    """Parameters of one expert (gate, up and down projections)."""
    kv_heads: int
    """Key/value heads per layer: the KV cache splits over at most this many tensor-parallel ranks."""
    kv_bytes_per_token: float
    """KV-cache bytes one token of context occupies, all layers, at `kv_dtype_bytes`."""
    attn_flops_per_token_ctx: float
    """Attention FLOPs (QK^T and PV) per query token per context token, all layers."""
    score_heads: float
    """Query heads summed over layers: the (query, key) scores one query token computes per context token."""
    vocab: int
    """Output rows of the LM head (the sampler reads one float per row per query token)."""
    embed_params: float
    """Embedding-table parameters: stored (and refit) but only a few rows read per forward."""

    @property
    def total_params(self) -> float:
        """Every stored parameter (memory, refit bytes, optimizer states)."""
        return self.dense_params + self.moe_layers * self.experts * self.expert_params + self.embed_params

    @property
    def active_params(self) -> float:
        """Parameters one token multiplies (training and prefill FLOPs are 2x / 6x this per token)."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer that `tokens` routed tokens read.

        With uniform routing each expert is missed by one token with probability 1 - top_k/E, so by all tokens
        with (1 - top_k/E)^tokens: E (1 - (1 - top_k/E)^tokens). Verifying k+1 tokens per sequence therefore
        reads more expert weights than decoding one.
        """
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** max(tokens, 0.0))


def attention_params(m: ModelConfig, in_width: int) -> float:
    q = m.num_attention_heads * m.head_dim
    kv = m.num_key_value_heads * m.head_dim
    return in_width * (q + 2 * kv) + q * m.hidden_size


def shape_of(m: ModelConfig, name: str = "model", kv_dtype_bytes: float = 2) -> CostShape:
    """The cost shape of a full decoder (target policy or a separate draft model)."""
    h = m.hidden_size
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    dense_layers = m.num_hidden_layers - moe_layers
    attn = attention_params(m, h) * m.num_hidden_layers
    mlp = 3 * h * m.intermediate_size * dense_layers
    router = h * m.num_experts * moe_layers
    head = m.vocab_size * h  # read every forward even when tied to the embedding
    return CostShape(
        name=name, layers=m.num_hidden_layers, hidden=h, dense_params=attn + mlp + router + head,
        moe_layers=moe_layers, experts=m.num_experts, top_k=m.num_experts_per_tok,
        expert_params=3 * h * m.moe_intermediate_size, kv_heads=m.num_key_value_heads,
        kv_bytes_per_token=2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * kv_dtype_bytes,
        attn_flops_per_token_ctx=4 * m.num_hidden_layers * m.num_attention_heads * m.head_dim,
        score_heads=m.num_hidden_layers * m.num_attention_heads, vocab=m.vocab_size,
        embed_params=0 if m.tie_word_embeddings else m.vocab_size * h,
    )


def drafter_shape(target: ModelConfig, kind: str, draft_model: str = "", layers: int = 1,
                  draft_vocab: int = 0, kv_dtype_bytes: float = 2) -> CostShape | None:
    """The cost shape of one draft forward of the drafter the simulator calls `kind` (its registry entry's
    `sim_shape`, written in the drafter's folder); None for drafters that use no accelerator (n-gram / history).
    `draft_model`: a preset name, for a separate draft model; `layers`, `draft_vocab`: a head's layers and draft
    vocabulary (0: its default)."""
    method = sim_drafter(kind)
    if method.sim_shape is None:
        return None
    return method.sim_shape(target, draft_model, layers, draft_vocab, kv_dtype_bytes)


@dataclass(frozen=True)
class HeadLayer:
    """What one decoder layer of a drafter head shaped like the target's layers costs: the numbers a head's
    `sim_shape` builds from."""

    target: CostShape
    """The target's own cost shape."""
    kv_bytes_per_token: float
    """KV-cache bytes per context token of one target layer."""
    attn_flops_per_token_ctx: float
    """Attention FLOPs per query and context token of one target layer."""
    ffn: int
    """The dense MLP's intermediate size (the target's, or 4 H when it has none)."""


def head_layer(target: ModelConfig, layers: int, kv_dtype_bytes: float) -> HeadLayer:
    """`HeadLayer` of `target`; a head of fewer than one layer raises."""
    if layers < 1:
        raise ValueError(f"drafter layers must be >= 1, got {layers}")
    t = shape_of(target, kv_dtype_bytes=kv_dtype_bytes)
    return HeadLayer(t, t.kv_bytes_per_token / t.layers, t.attn_flops_per_token_ctx / t.layers,
                     target.intermediate_size or 4 * target.hidden_size)
