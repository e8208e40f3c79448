"""Named architectures: the project's tiny reference models and the public models we plan for.

Values for public models come from their HF `config.json` (docs/design/references.md lists them). The tiny models are sized
so that pretraining on the synthetic task takes minutes on two CPU cores.
"""

from __future__ import annotations

from .config import ModelConfig

# Character-level vocabulary of the synthetic task (megatron_spec.tasks) fits in 64 ids.
TINY_VOCAB = 64

PRESETS: dict[str, dict] = {
    "tiny-qwen3": dict(
        model_type="qwen3", vocab_size=TINY_VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    # The main job's policy: deeper and narrower than tiny-qwen3, so a one-layer MTP head costs an eighth of the
    # trunk (as a head does at scale) rather than a quarter.
    "tiny-qwen3-deep": dict(
        model_type="qwen3", vocab_size=TINY_VOCAB, hidden_size=96, num_hidden_layers=8, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32, intermediate_size=288, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    # Narrower and deeper again, tried as the main job's policy and not kept (research/notebook/README.md, "A narrower, deeper
    # policy"): at hidden 64 a token costs less than half of hidden 96's arithmetic while a step's fixed cost grows
    # with the layers, so a verify at 64 sequences costs fewer plain steps (7 % fewer on the trained policy), but its
    # MTP head drafted less and it learned slower. Kept so the documented pretraining commands run.
    "tiny-qwen3-narrow": dict(
        model_type="qwen3", vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=12, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=192, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=512,
    ),
    "tiny-draft": dict(
        model_type="qwen3", vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=192, rope_theta=10000.0, max_position_embeddings=512,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1e6, max_position_embeddings=40960,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, rope_theta=1e6, max_position_embeddings=40960,
    ),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, intermediate_size=12288, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, rope_theta=1e6, max_position_embeddings=40960,
    ),
}


def preset(name: str) -> ModelConfig:
    """The `ModelConfig` of a named preset; unknown names list the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: known are {', '.join(PRESETS)}")
    return ModelConfig(**PRESETS[name])
