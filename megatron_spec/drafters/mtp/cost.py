"""What one MTP draft forward costs in the simulator (the registry entry's `sim_shape`)."""

from __future__ import annotations

from ...models.config import ModelConfig
from ...sim.shapes import CostShape, attention_params, head_layer


def mtp_shape(target: ModelConfig, draft_model: str, layers: int, draft_vocab: int,
              kv_dtype_bytes: float) -> CostShape:
    """`layers` modules, each a 2H -> H projection and one decoder layer like the target's (MoE if the target's
    layers are MoE), sharing the target's full-vocabulary LM head."""
    one = head_layer(target, layers, kv_dtype_bytes)
    t, h, moe = one.target, target.hidden_size, target.is_moe
    dense = layers * (attention_params(target, h) + 2 * h * h + (h * t.experts if moe else 3 * h * one.ffn))
    dense += target.vocab_size * h
    return CostShape(
        name="mtp", layers=layers, hidden=h, dense_params=dense, moe_layers=layers if moe else 0,
        experts=t.experts, top_k=t.top_k, expert_params=t.expert_params, kv_heads=t.kv_heads,
        kv_bytes_per_token=layers * one.kv_bytes_per_token, attn_flops_per_token_ctx=layers * one.attn_flops_per_token_ctx,
        score_heads=layers * target.num_attention_heads, vocab=target.vocab_size, embed_params=0,
    )
