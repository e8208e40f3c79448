"""Model architecture config, read from and written to HF `config.json` dictionaries.

One dataclass covers the three families we support (Qwen3 dense, Qwen3-MoE, Llama): they share the decoder
skeleton and differ in a few switches (QK-norm, MoE MLP, tied embeddings).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}


def token_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    """An HF-style token-id field (one id, a list of them, or None) as a tuple, e.g. `eos_token_id`."""
    return tuple(ids) if isinstance(ids, list) else () if ids is None else (ids,)


@dataclass
class ModelConfig:
    model_type: str
    """Family: one of `SUPPORTED_MODEL_TYPES` (HF's `model_type`)."""
    vocab_size: int
    """Rows of the embedding and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (grouped-query attention when fewer than query heads)."""
    head_dim: int = 0
    """Width of one attention head; 0 means hidden_size // num_attention_heads (Llama's convention)."""
    intermediate_size: int = 0
    """FFN width of dense layers (unused by MoE layers)."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Qwen3 uses 1e6)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model was trained for; prompts + generation must fit in it."""
    tie_word_embeddings: bool = False
    """Output head shares the embedding matrix (SmolLM2: yes, Qwen3 8B+: no)."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections."""
    qk_norm: bool | None = None
    """RMSNorm over each query and key head before RoPE (Qwen3's QK-norm); None takes the family's default."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """FFN width of one expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (HF's `norm_topk_prob`)."""
    decoder_sparse_step: int = 1
    """Every `decoder_sparse_step`-th layer is MoE (HF Qwen3-MoE convention)."""
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    """Layers that stay dense in an MoE model."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss when training adds it."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the tokenizer uses one."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token(s); generation stops on them by default."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model_type {self.model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.qk_norm is None:
            self.qk_norm = self.model_type.startswith("qwen3")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.is_moe:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ValueError("moe_intermediate_size must be >= 1 for an MoE model")
        elif self.intermediate_size < 1:
            raise ValueError("intermediate_size must be >= 1 for a dense model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from an HF `config.json` dict (transformers 4.x and 5.x spellings)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model_type {model_type!r} in config.json: supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        if model_type == "qwen3_moe":
            kwargs["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", 0))
        else:
            kwargs["num_experts"] = 0
        kwargs["head_dim"] = hf.get("head_dim") or 0
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """HF `config.json` dict that transformers loads into the matching architecture."""
        out = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return out
