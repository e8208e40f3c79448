"""HF config -> Megatron-Core `TransformerConfig` + layer specs -> `GPTModel` for this rank's pipeline stage.

Qwen3 / Qwen3-MoE (and Llama) in Megatron terms: RMSNorm, SwiGLU (`gated_linear_unit` + SiLU), QK-norm
(`qk_layernorm`), RoPE with the HF base, GQA (`num_query_groups`), untied output layer, no biases; MoE layers use a
softmax router over the top-k logits (`moe_router_pre_softmax=False`, equal to HF's softmax -> top-k ->
renormalise) or, when HF does not renormalise, softmax before top-k. MTP layers come from Megatron-Core's MTP
block spec, whose inner layer is the last decoder layer's spec.

The local spec (plain torch + Megatron-Core modules) is used when Transformer Engine is absent, so the model builds
on CPU without TE or Apex; with TE installed and a GPU, the TE spec is used (fused norms change some parameter
names, which `mapping` knows).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from megatron_spec.models import ModelConfig

from . import require_megatron
from .checks import Parallelism, check_parallelism
from .cpu import on_cpu
from .mapping import padded_vocab_size

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

DEFAULT_VOCAB_DIVISIBLE_BY = 128


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


TE_EXTRA = "pip install 'megatron-spec[te]' (Transformer Engine for PyTorch, on a CUDA machine)"


@dataclass(frozen=True)
class Speed:
    """How Megatron runs the model fast, as `backend.megatron` says (its docstrings); None / `auto`: the fastest
    safe setting where Transformer Engine and CUDA are present, what works on CPUs otherwise."""

    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ()
    moe_token_dispatcher: str = "auto"
    moe_grouped_gemm: bool | None = None
    moe_permute_fusion: bool | None = None
    fusions: bool | None = None

    @classmethod
    def from_section(cls, m) -> "Speed":
        return cls(**{f.name: getattr(m, f.name) for f in fields(cls)})


PORTABLE = Speed(moe_token_dispatcher="allgather", moe_grouped_gemm=False, moe_permute_fusion=False, fusions=False)
"""Settings that run on any machine, CPU or GPU, with or without Transformer Engine: `MegatronPolicy`'s default
when it is built directly rather than from a config."""


def speed_overrides(speed: Speed, *, moe: bool, cuda: bool | None = None, te: bool | None = None) -> dict:
    """`TransformerConfig` fields for `speed`. Raises before anything is built where a setting needs Transformer
    Engine (grouped GEMM, permute fusion, the fused kernels) and it is absent, or needs CUDA on a CPU: on a GPU the
    defaults are those settings, so a GPU machine without Transformer Engine is told to install it (or to turn
    them off one by one)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = have_transformer_engine() if te is None else te
    fast = cuda  # the defaults a GPU gets; they need Transformer Engine, which the check below asks for
    wanted = {"moe_grouped_gemm": speed.moe_grouped_gemm, "moe_permute_fusion": speed.moe_permute_fusion,
              "fusions": speed.fusions}
    resolved = {k: fast if v is None else v for k, v in wanted.items()}
    if not moe:
        resolved["moe_grouped_gemm"] = resolved["moe_permute_fusion"] = False
    needs_te = [k for k, on in resolved.items() if on]
    if needs_te and not (te and cuda):
        where = "CUDA and Transformer Engine" if not cuda else "Transformer Engine"
        raise ValueError(f"backend.megatron {', '.join(needs_te)} need {where}"
                         + (f": {TE_EXTRA}" if cuda else "") + f", or set backend.megatron.{needs_te[0]}=false"
                         + (" (and the others listed)" if len(needs_te) > 1 else ""))
    dispatcher = speed.moe_token_dispatcher
    if dispatcher == "auto":
        dispatcher = "alltoall" if cuda else "allgather"
    if moe and dispatcher == "alltoall" and not cuda:
        raise ValueError("backend.megatron.moe_token_dispatcher=alltoall needs CUDA (Megatron-Core's alltoall "
                         "dispatcher makes CUDA streams): use allgather on CPUs")
    out = dict(moe_grouped_gemm=resolved["moe_grouped_gemm"], moe_permute_fusion=resolved["moe_permute_fusion"],
               bias_activation_fusion=resolved["fusions"], apply_rope_fusion=resolved["fusions"],
               masked_softmax_fusion=resolved["fusions"])
    if moe:
        out["moe_token_dispatcher_type"] = dispatcher
    if speed.recompute != "none":
        out["recompute_granularity"] = speed.recompute
    if speed.recompute == "full":
        out.update(recompute_method=speed.recompute_method, recompute_num_layers=speed.recompute_num_layers)
    if speed.recompute == "selective" and speed.recompute_modules:
        out["recompute_modules"] = list(speed.recompute_modules)
    return out


def _router_without_te() -> None:
    # megatron-core 0.16 reads `moe_utils.te_general_gemm` in the router's matmul but only defines it when TE
    # imports, so MoE layers fail with NameError without TE (0.19 sets it to None). Define the missing name.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(
    cfg: ModelConfig,
    par: Parallelism,
    *,
    mtp_num_layers: int = 0,
    dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    init: bool = True,
    **overrides,
) -> TransformerConfig:
    """The `TransformerConfig` of `cfg` split as `par`; `overrides` go straight to TransformerConfig."""
    check_parallelism(cfg, par)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size if cfg.intermediate_size > 0 else cfg.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # Fusions need CUDA kernels (or TE / Apex); the unfused paths compute the same function.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        virtual_pipeline_model_parallel_size=par.vp if par.vp > 1 else None,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=init,
    )
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_pre_softmax=not cfg.norm_topk_prob,
            moe_layer_freq=[1 if cfg.is_moe_layer(i) else 0 for i in range(cfg.num_hidden_layers)],
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=cfg.router_aux_loss_coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather",  # `speed_overrides` picks the dispatcher and the fusions
            moe_grouped_gemm=False,
        )
    if mtp_num_layers:
        kwargs.update(mtp_num_layers=mtp_num_layers, mtp_loss_scaling_factor=0.1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_specs(config: TransformerConfig, use_te: bool, pp_rank: int, vp_stage: int | None = None):
    """(decoder block spec, MTP block spec or None) for one pipeline stage (its chunk `vp_stage` when interleaved)."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank,
                                       vp_stage=vp_stage)
    mtp = None
    if config.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=use_te, pp_rank=pp_rank,
                                     vp_stage=vp_stage)
    return block, mtp


def build_model(
    cfg: ModelConfig,
    par: Parallelism,
    *,
    mtp_num_layers: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    use_te: bool | None = None,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    init: bool = True,
    vp_stage: int | None = None,
    **overrides,
) -> GPTModel:
    """This rank's `GPTModel` (its pipeline stage) for `cfg`; model-parallel state must be initialised as `par`.
    With `par.vp > 1`, the stage's chunk `vp_stage` (`build_chunks` builds them all).

    `seed` seeds Megatron-Core's initialisation (CPU: the full weights are drawn on every rank and split, so a
    given seed gives the same model for any TP); `init=False` skips it for models about to be loaded.
    `use_te`: None picks Transformer Engine when it is installed and CUDA is available.
    """
    if ps.get_tensor_model_parallel_world_size() != par.tp or ps.get_pipeline_model_parallel_world_size() != par.pp:
        raise RuntimeError(f"model-parallel state does not match {par.describe()}: call init_model_parallel(par) first")
    if use_te is None:
        use_te = have_transformer_engine() and torch.cuda.is_available()
    if not use_te:
        _router_without_te()
    config = transformer_config(cfg, par, mtp_num_layers=mtp_num_layers, dtype=dtype, init=init, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    if torch.cuda.is_available() and (seed is not None or not tensor_parallel.get_cuda_rng_tracker().get_states()):
        # Megatron-Core's attention forks the model-parallel CUDA RNG state, which must exist before a forward.
        tensor_parallel.model_parallel_cuda_manual_seed(0 if seed is None else seed)
    if (par.vp > 1) != (vp_stage is not None) or (vp_stage is not None and not 0 <= vp_stage < par.vp):
        raise ValueError(f"vp_stage={vp_stage} for {par.describe()}: give one chunk index below vp when vp > 1, "
                         "else None")
    pp_rank = ps.get_pipeline_model_parallel_rank()
    block, mtp = layer_specs(config, use_te, pp_rank, vp_stage)
    with on_cpu():  # no-op with CUDA; on CPU, lets PP > 1 sync the embedding copy of MTP / tied heads
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=padded_vocab_size(cfg.vocab_size, vocab_divisible_by, par.tp),
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.rope_theta,
            rotary_percent=1.0,
            mtp_block_spec=mtp,
            vp_stage=vp_stage,
        )
    if torch.cuda.is_available():
        # Megatron-Core allocates its parallel linears on the current GPU, but a module it takes from torch (the
        # RMSNorm it falls back to without Apex / Transformer Engine) is made on the CPU: move the whole stage, as
        # Megatron's own training scripts do after building.
        model.cuda(torch.cuda.current_device())
    model.hf_config = cfg  # what the importer and exporter map against
    return model


def build_chunks(cfg: ModelConfig, par: Parallelism, **kwargs) -> list[GPTModel]:
    """This rank's model chunks: its one `GPTModel` stage, or with `par.vp > 1` its vp chunks in schedule order
    (chunk v holds the (v x pp + pp_rank)-th run of layers, Megatron-Core's interleaved layout); `build_model`'s
    keyword arguments."""
    if par.vp == 1:
        return [build_model(cfg, par, **kwargs)]
    return [build_model(cfg, par, vp_stage=v, **kwargs) for v in range(par.vp)]
