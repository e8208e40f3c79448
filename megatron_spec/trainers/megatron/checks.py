"""Bad input caught before any model is built: parallel sizes that do not divide the model, checkpoints whose
config does not match the requested architecture. Pure functions (no megatron-core, no process group).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.layout import Layout, layout_problems, sequence_parallel_problems, support_problems, world_problems
from megatron_spec.models import ModelConfig
from megatron_spec.rl.backend_config import OPTIMIZERS, PARAMS_DTYPES, RECOMPUTE

# Fields that define the parameter shapes and the function the model computes. A checkpoint that differs in any
# of them is a different model, even when some shapes happen to agree.
ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
    "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
)


@dataclass(frozen=True)
class Parallelism(Layout):
    """How one model is split over ranks: `megatron_spec.layout.Layout` (TP, PP, EP, ETP, CP and Megatron-Core's
    uneven first / last pipeline stages), the one layout the simulator and the recipes validate too."""

    @classmethod
    def from_section(cls, section) -> "Parallelism":
        """From `RLConfig.backend.megatron` (`MegatronSection`)."""
        return cls(**vars(section.layout()))


def check_parallelism(cfg: ModelConfig, par: Layout, world_size: int | None = None, *,
                      sequence_parallel: bool | None = None, on_gpus: bool = True) -> None:
    """Raise one ValueError listing every way `par` cannot split `cfg` (and `world_size`, when given): the shared
    layout rules (`megatron_spec.layout`) plus what this backend does not implement; with `sequence_parallel`
    given, also whether it suits the model and the device (`sequence_parallel_problems`; `on_gpus`: CUDA)."""
    problems = layout_problems(cfg, par) + support_problems(par)
    if sequence_parallel is not None:
        problems += sequence_parallel_problems(cfg, par, sequence_parallel, on_gpus=on_gpus)
    if cfg.attention_bias:
        problems.append("attention_bias=True is not supported by the Megatron backend (Qwen3 and Llama have none)")
    if world_size is not None:
        problems += world_problems(world_size, par)
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


def check_trainer_settings(grpo, par: Layout, params_dtype: str, recompute: str, optimizer: str, *,
                           on_gpus: bool) -> None:
    """Raise on a trainer setting the Megatron policy does not know or does not implement (`grpo`: the GRPO
    section; `on_gpus`: CUDA is available), before anything is built: the policy is also built without a config."""
    if grpo.kl_coef > 0:
        raise NotImplementedError("the Megatron trainer has no reference model yet: use grpo.kl_coef=0")
    if par.cp > 1:
        raise NotImplementedError("context parallelism (cp > 1) is not wired into the Megatron trainer yet")
    if params_dtype not in PARAMS_DTYPES:
        raise ValueError(f"params_dtype must be one of {', '.join(PARAMS_DTYPES)}, got {params_dtype!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if optimizer == "megatron" and not on_gpus:
        raise NotImplementedError("backend.megatron.optimizer=megatron (Megatron-Core's distributed optimizer) "
                                  "needs CUDA; on the CPU use optimizer=torch (AdamW per shard, fp32 masters)")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be torch or megatron, got {optimizer!r}")
