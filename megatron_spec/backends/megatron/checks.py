"""Bad input caught before any model is built: parallel sizes that do not divide the model, checkpoints whose
config does not match the requested architecture. Pure functions (no megatron-core, no process group).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.models import ModelConfig

# Fields that define the parameter shapes and the function the model computes. A checkpoint that differs in any
# of them is a different model, even when some shapes happen to agree.
ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
    "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
)


@dataclass(frozen=True)
class Parallelism:
    """How one model is split over ranks (Megatron-Core's names in brackets)."""

    tp: int = 1
    """Tensor parallel size: heads / query groups, FFN columns and the vocabulary are split [tensor_model_parallel_size]."""
    pp: int = 1
    """Pipeline parallel size: consecutive layers per stage, MTP on the last one [pipeline_model_parallel_size]."""
    ep: int = 1
    """Expert parallel size: each rank holds num_experts / ep consecutive experts [expert_model_parallel_size]."""
    etp: int | None = None
    """Expert tensor parallel size: each expert's FFN split over etp ranks; None means tp [expert_tensor_parallel_size]."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"etp must be >= 1 or None, got {self.etp}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def describe(self) -> str:
        return f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.expert_tp}"


def check_parallelism(cfg: ModelConfig, par: Parallelism, world_size: int | None = None) -> None:
    """Raise one ValueError listing every way `par` cannot split `cfg` (and `world_size`, when given)."""
    problems = []
    if cfg.num_attention_heads % par.tp:
        problems.append(f"TP={par.tp} does not divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_key_value_heads % par.tp:
        problems.append(
            f"TP={par.tp} does not divide the query groups (num_key_value_heads={cfg.num_key_value_heads}); "
            "Megatron-Core keeps each query group on one rank"
        )
    has_dense = not cfg.is_moe or any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if has_dense and cfg.intermediate_size % par.tp:
        problems.append(f"TP={par.tp} does not divide intermediate_size={cfg.intermediate_size}")
    if cfg.is_moe:
        if cfg.num_experts % par.ep:
            problems.append(f"EP={par.ep} does not divide num_experts={cfg.num_experts}")
        if cfg.moe_intermediate_size % par.expert_tp:
            problems.append(f"ETP={par.expert_tp} does not divide moe_intermediate_size={cfg.moe_intermediate_size}")
    elif par.ep > 1:
        problems.append(f"EP={par.ep} needs an MoE model, but {cfg.model_type} has no experts")
    if cfg.num_hidden_layers % par.pp:
        problems.append(f"PP={par.pp} does not divide num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.attention_bias:
        problems.append("attention_bias=True is not supported by the Megatron backend (Qwen3 and Llama have none)")
    if world_size is not None:
        if world_size % (par.tp * par.pp):
            problems.append(f"world size {world_size} is not a multiple of TP x PP = {par.tp * par.pp}")
        if world_size % (par.expert_tp * par.ep * par.pp):
            problems.append(
                f"world size {world_size} is not a multiple of ETP x EP x PP = {par.expert_tp * par.ep * par.pp} "
                "(set etp=1 to use EP without splitting each expert)"
            )
    if problems:
        raise ValueError(f"cannot split {cfg.model_type} with {par.describe()}: " + "; ".join(problems))


def check_config_match(checkpoint: ModelConfig, requested: ModelConfig, where: str = "checkpoint") -> None:
    """Raise a ValueError naming every architecture field where `checkpoint` differs from `requested`."""
    diffs = [
        f"{f}: {where} {getattr(checkpoint, f)!r} != requested {getattr(requested, f)!r}"
        for f in ARCHITECTURE_FIELDS
        if getattr(checkpoint, f) != getattr(requested, f)
    ]
    if diffs:
        raise ValueError(f"{where} config does not match the requested architecture: " + "; ".join(diffs))
