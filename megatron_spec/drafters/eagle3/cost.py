"""What one EAGLE-3 draft forward costs in the simulator (the registry entry's `sim_shape`)."""

from __future__ import annotations

from ...models.config import ModelConfig
from ...sim.shapes import CostShape, attention_params, head_layer

EAGLE3_DRAFT_VOCAB = 32000
"""Public EAGLE-3 heads (e.g. for Llama-3.1-8B, Qwen3-8B) predict over a reduced 32k-token draft vocabulary."""


def eagle3_shape(target: ModelConfig, draft_model: str, layers: int, draft_vocab: int,
                 kv_dtype_bytes: float) -> CostShape:
    """`layers` decoder layers whose q/k/v read [embedding, hidden] (2H wide), an fc fusing three target hidden
    states (3H -> H) and an LM head over `draft_vocab` rows (32k in public heads). Its embedding is the target's,
    so it adds no stored embedding."""
    one = head_layer(target, layers, kv_dtype_bytes)
    h = target.hidden_size
    vocab = draft_vocab or min(EAGLE3_DRAFT_VOCAB, target.vocab_size)
    dense = layers * (attention_params(target, 2 * h) + 3 * h * one.ffn) + 3 * h * h + vocab * h
    return CostShape(
        name="eagle3", layers=layers, hidden=h, dense_params=dense, moe_layers=0, experts=0, top_k=0,
        expert_params=0, kv_heads=one.target.kv_heads, kv_bytes_per_token=layers * one.kv_bytes_per_token,
        attn_flops_per_token_ctx=layers * one.attn_flops_per_token_ctx,
        score_heads=layers * target.num_attention_heads, vocab=vocab, embed_params=0,
    )
