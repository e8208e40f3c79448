"""One validator for parallel layouts: does a (TP, PP, EP, ETP, CP) split fit a model and a number of devices?

The Megatron backend (`trainers/megatron/checks.py`), the simulator (`sim/config.py`) and the recipes
(`recipes/_common.py::Scale`) all ask this module, so a layout one of them accepts the others accept too. Pure:
no torch.distributed, no Megatron import; the rules are Megatron-Core's (and vLLM's for a generation engine):

- TP splits the attention heads and the query groups (KV heads); Megatron keeps each query group on one rank, so
  TP must divide both. A vLLM engine may instead replicate KV heads (`kv_replication`): TP a multiple of them.
- TP splits the FFN columns of dense layers; ETP (expert TP, default TP) splits each expert's FFN; EP spreads the
  experts, so EP must divide the expert count (and needs an MoE model).
- VP (virtual pipeline, Megatron-Core's interleaved 1F1B) gives each stage `vp` equal chunks of its layers instead
  of one run (chunk v of stage s is the (v x pp + s)-th run of the model), so every stage's layer count, even or
  uneven, must divide by vp.
- PP gives each stage consecutive layers. Megatron-Core splits them evenly, or, with
  `num_layers_in_first_pipeline_stage` / `..._last_...` set, gives those counts to the first / last stage and
  splits the rest evenly over the stages between (`stage_layers`). Every stage needs at least one layer.
- Devices: the dense grid is TP x CP x PP x DP and the expert grid ETP x EP x PP x expert-DP over the same devices,
  so the world must be a multiple of TP x CP x PP and of ETP x EP x PP.

Apart from what Megatron-Core accepts, `support_problems` says what this project's Megatron trainer runs: no
context parallelism (CP > 1) yet (virtual pipeline stages over PP = 1 interleave nothing: `Layout` refuses them).
The config, the recipes, the launch checks, the backend and the tuner all refuse or skip such a layout through it,
before anything is loaded; the simulator may still predict one when asked directly.
`sequence_parallel_problems` (MoE under TP needs sequence parallelism, CPUs cannot run it) and
`colocation_problems` (a colocated engine's GPUs on one node) are the other rules found only after the allocation starts.

`Layout` is the one description of a run's parallel layout, used by the config (`backend.megatron`), the recipes,
the simulator and the tuner: the trainer's degrees and, where the run has engines, one engine's split, their
count and whether they share the trainer's devices. `Layout.problems` is the one check that composes the rules
above, and `Layout.overrides` the one conversion to the config keys users write.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import ModelConfig


@dataclass(frozen=True)
class Layout:
    """How a model is split over devices (Megatron-Core's names in brackets)."""

    tp: int = 1
    """Tensor parallel size [tensor_model_parallel_size]."""
    pp: int = 1
    """Pipeline parallel stages [pipeline_model_parallel_size]."""
    ep: int = 1
    """Expert parallel size [expert_model_parallel_size]."""
    etp: int | None = None
    """Expert tensor parallel size; None: tp [expert_tensor_parallel_size]."""
    cp: int = 1
    """Context parallel size [context_parallel_size]."""
    first_stage_layers: int | None = None
    """Decoder layers of the first stage; None: an even share [num_layers_in_first_pipeline_stage]."""
    last_stage_layers: int | None = None
    """Decoder layers of the last stage; None: an even share [num_layers_in_last_pipeline_stage]."""
    vp: int = 1
    """Model chunks per pipeline stage, run by the interleaved 1F1B schedule, which divides the pipeline bubble by
    `vp`; 1: one run of consecutive layers per stage [virtual_pipeline_model_parallel_size]."""
    dp: int | None = None
    """Data-parallel replicas of the trainer; None: whatever the devices leave, world / (tp x cp x pp) (a config
    does not name it; the simulator and the tuner do)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the TP ranks (needs tp > 1) [sequence_parallel]."""
    engine: Layout | None = None
    """One generation engine's split: its GPUs as `tp` (vLLM tensor_parallel_size) and, of those, the ranks its
    experts spread over as `ep`; None: the layout describes no engines (a trainer alone, or an engine itself)."""
    engines: int = 1
    """Generation engines (`backend.generators`)."""
    colocated: bool = True
    """The engines time-share the trainer's devices; False: they have devices of their own (disaggregated)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "engines"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vp < 1:
            raise ValueError(f"virtual_pipeline must be >= 1, got {self.vp}")
        if self.vp > 1 and self.pp == 1:
            raise ValueError(f"virtual_pipeline={self.vp} interleaves pipeline stages: it needs pp > 1 "
                             "(or set virtual_pipeline=1)")
        for name in ("etp", "first_stage_layers", "last_stage_layers", "dp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.engine is not None and self.engine.engine is not None:
            raise ValueError("an engine's layout describes one engine: it has no engines of its own")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def gpus(self) -> int:
        """Devices of the trainer, tp x pp x cp x dp (dp None counts one replica)."""
        return self.tp * self.pp * self.cp * (self.dp or 1)

    def describe(self) -> str:
        text = f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.expert_tp} CP={self.cp}"
        if self.vp > 1:
            text += f" VP={self.vp}"
        if self.first_stage_layers or self.last_stage_layers:
            text += f" (first stage {self.first_stage_layers}, last stage {self.last_stage_layers} layers)"
        return text

    def problems(self, m: ModelConfig | None = None, world: int | None = None, *, runnable: bool = False,
                 on_gpus: bool = True, who: str = "") -> list[str]:
        """Every reason this layout cannot run (empty when it can), the one check every caller asks: the trainer's
        split of model `m` (None: skipped) as Megatron-Core takes it, its grids on `world` trainer devices (None:
        skipped), and the engine's split as vLLM takes it; with `runnable`, also what this project does not run
        (`support_problems`, sequence parallelism, colocated engines across nodes; `on_gpus` False: CPU devices).
        `who` prefixes the trainer's sizes; the engine's are prefixed "generation"."""
        p = f"{who} " if who else ""
        problems = []
        if runnable:
            problems += support_problems(self, who)
            if self.sequence_parallel and self.tp == 1:
                problems.append(f"{p}sequence_parallel needs tp > 1")
            problems += sequence_parallel_problems(m, self, self.sequence_parallel, on_gpus=on_gpus, who=who)
        if m is not None:
            problems += layout_problems(m, self, who=who)
        if world is not None:
            problems += world_problems(world, self, who)
        if self.engine is not None:
            problems += engine_problems(m, self.engine)
            if runnable:
                problems += colocation_problems(self.colocated, self.engine.tp, on_gpus=on_gpus)
        return problems

    def overrides(self) -> dict[str, object]:
        """This layout as dotted `RLConfig` overrides under the keys users write (`backend.megatron.*`, and with an
        engine `backend.vllm.tensor_parallel_size`, `backend.generators`, `backend.placement`): the one conversion
        from a layout to a config."""
        out: dict[str, object] = {
            "backend.megatron.tp": self.tp, "backend.megatron.pp": self.pp, "backend.megatron.ep": self.ep,
            "backend.megatron.etp": self.etp, "backend.megatron.cp": self.cp,
            "backend.megatron.first_stage_layers": self.first_stage_layers,
            "backend.megatron.last_stage_layers": self.last_stage_layers,
            "backend.megatron.virtual_pipeline": self.vp, "backend.megatron.sequence_parallel": self.sequence_parallel}
        if self.engine is not None:
            out.update({"backend.vllm.tensor_parallel_size": self.engine.tp, "backend.generators": self.engines,
                        "backend.placement": "colocated" if self.colocated else "disaggregated"})
        return out


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers per pipeline stage as Megatron-Core assigns them; ValueError when it cannot."""
    if pp == 1:
        if (first or num_layers) != num_layers or (last or num_layers) != num_layers:
            raise ValueError(f"pp=1 has one stage of all {num_layers} layers: first/last stage layers must be unset")
        return [num_layers]
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds num_hidden_layers={num_layers}: a pipeline stage needs at least one layer")
    fixed = [x for x in (first, last) if x is not None]
    middle_stages, rest = pp - len(fixed), num_layers - sum(fixed)
    if rest < middle_stages or (middle_stages == 0 and rest != 0):
        raise ValueError(f"pp={pp} with first/last stage layers {first}/{last} leaves {rest} of num_hidden_layers="
                         f"{num_layers} for the other {middle_stages} stage(s), which need at least one each"
                         + (" and exactly none left over" if middle_stages == 0 else ""))
    if middle_stages and rest % middle_stages:
        hint = "" if fixed else f"; Megatron-Core accepts first/last stage layers {suggest_split(num_layers, pp)}"
        raise ValueError(f"pp={pp} does not divide the {rest} layer(s) left for {middle_stages} evenly split stage(s) "
                         f"(num_hidden_layers={num_layers}){hint}")
    even = rest // middle_stages if middle_stages else 0
    return [first if first is not None else even, *[even] * (pp - 2), last if last is not None else even]


def suggest_split(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """(first, last) stage layers that Megatron-Core accepts for `num_layers` over `pp` stages with the smallest
    largest stage (the one that paces the pipeline): (None, None) when pp divides the layers; 94 layers over 8
    stages: 11 and 11, with six stages of 12 between. Some counts cannot reach ceil(L / pp) under Megatron's rule
    (equal middle stages): 9 layers over 6 stages give 3, 1, 1, 1, 1, 2. ValueError when pp > num_layers."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds num_hidden_layers={num_layers}: a pipeline stage needs at least one layer")
    if num_layers % pp == 0:
        return None, None
    if pp == 2:
        return num_layers - num_layers // 2, num_layers // 2
    best = None
    for per in range(1, num_layers // (pp - 2) + 1):  # layers of each middle stage
        ends = num_layers - per * (pp - 2)
        if ends >= 2 and (best is None or max(per, ends - ends // 2) < best[0]):
            best = (max(per, ends - ends // 2), ends - ends // 2, ends // 2)
    return best[1], best[2]


def layout_problems(m: ModelConfig, lay: Layout, *, kv_replication: bool = False, who: str = "") -> list[str]:
    """Every way `lay` cannot split `m` (empty when it fits); `who` prefixes each size ("train tp=3 ...")."""
    p = f"{who} " if who else ""
    problems = []
    if m.num_attention_heads % lay.tp:
        problems.append(f"{p}tp={lay.tp} does not divide num_attention_heads={m.num_attention_heads}")
    kv = m.num_key_value_heads
    if kv_replication:
        if kv % lay.tp and lay.tp % kv:
            problems.append(f"{p}tp={lay.tp} and num_key_value_heads={kv}: one must divide the other (KV heads are "
                            "split or replicated across tensor-parallel ranks)")
    elif kv % lay.tp:
        problems.append(f"{p}tp={lay.tp} does not divide the query groups (num_key_value_heads={kv}); "
                        "Megatron-Core keeps each query group on one rank")
    has_dense = not m.is_moe or any(not m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    if has_dense and m.intermediate_size % lay.tp:
        problems.append(f"{p}tp={lay.tp} does not divide intermediate_size={m.intermediate_size}")
    if m.is_moe:
        if m.num_experts % lay.ep:
            problems.append(f"{p}ep={lay.ep} does not divide num_experts={m.num_experts}")
        if m.moe_intermediate_size % lay.expert_tp:
            problems.append(f"{p}etp={lay.expert_tp} does not divide moe_intermediate_size={m.moe_intermediate_size}")
    elif lay.ep > 1:
        problems.append(f"{p}ep={lay.ep} needs an MoE model ({m.model_type} is dense)")
    try:
        stages = stage_layers(m.num_hidden_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    except ValueError as e:
        problems.append(f"{p}{e}")
        stages = []
    if lay.vp > 1 and lay.pp == 2 and lay.first_stage_layers and lay.last_stage_layers:
        problems.append(f"{p}virtual_pipeline={lay.vp} with both first and last stage layers set over pp=2: "
                        "Megatron-Core's interleaved layer offsets need a stage that takes the even share; set only "
                        "first_stage_layers (the last stage takes the rest), or virtual_pipeline=1")
    if lay.vp > 1 and any(n % lay.vp for n in stages):
        problems.append(f"{p}virtual_pipeline={lay.vp} does not divide the stages' layers {stages} "
                        f"(num_hidden_layers={m.num_hidden_layers}; each stage's chunks hold equal runs of layers): "
                        "pick virtual_pipeline (and first / last stage layers) so that it divides every stage's, "
                        "or virtual_pipeline=1")
    return problems


def world_problems(world: int, lay: Layout, who: str = "") -> list[str]:
    """Every way `world` devices cannot hold the dense and the expert grid of `lay`."""
    p = f"{who} " if who else ""
    problems = []
    dense, expert = lay.tp * lay.cp * lay.pp, lay.expert_tp * lay.ep * lay.pp
    if world % dense:
        problems.append(f"{p}TP*PP*CP = {dense} does not divide the {world} devices")
    if world % expert:
        problems.append(f"{p}EP*PP = {lay.ep * lay.pp} (x ETP {lay.expert_tp}) does not divide the {world} devices "
                        "(the expert grid; set etp=1 to use EP without splitting each expert)")
    return problems


SUPPORTED_CP = 1
"""The only context-parallel size the Megatron trainer runs: its forward does not split sequences over CP ranks."""


def support_problems(lay: Layout, who: str = "") -> list[str]:
    """Every part of `lay` that Megatron-Core accepts but this project's Megatron trainer does not run (empty when it
    runs): context parallelism (`cp > 1`) is not wired into its forward, so such a run would fail after the model
    loads. The message names the fix."""
    p = f"{who} " if who else ""
    if lay.cp != SUPPORTED_CP:
        return [f"{p}cp={lay.cp}: context parallelism is not implemented in the Megatron trainer (a run would stop "
                "after loading the model); use cp=1 and put those GPUs into tp, pp or data parallelism"]
    return []


def sequence_parallel_problems(m: ModelConfig | None, lay: Layout, sequence_parallel: bool, *, on_gpus: bool = True,
                               who: str = "") -> list[str]:
    """Every way `backend.megatron.sequence_parallel` does not suit `lay` for model `m` (None: the model rule is
    skipped) on GPUs or, with `on_gpus=False`, on CPUs. Megatron-Core's rules, met only at the first train step:
    its MoE layer raises in training when the attention TP group has more than one rank and sequence parallelism
    is off, so an MoE model with TP > 1 needs it; and its torch norm (the one used without Transformer Engine or
    Apex, both absent on the CPU) asserts that sequence parallelism is off, so a CPU (gloo) run cannot use it."""
    p = f"{who} " if who else ""
    problems = []
    if m is not None and m.is_moe and lay.tp > 1 and not sequence_parallel:
        problems.append(f"{p}tp={lay.tp} on an MoE model needs sequence parallelism (Megatron-Core refuses to train "
                        "MoE layers under tensor parallelism without it): set backend.megatron.sequence_parallel=true")
    if sequence_parallel and not on_gpus:
        moe = " (an MoE model then needs tp=1)" if m is not None and m.is_moe else ""
        problems.append(f"{p}sequence parallelism on CPUs: Megatron-Core's torch norms refuse it without Transformer "
                        f"Engine or Apex, which need CUDA; set backend.megatron.sequence_parallel=false{moe}")
    return problems


def online_eagle3_problems(mtp_num_layers: int, vp: int = 1) -> list[str]:
    """Megatron trainer settings an online EAGLE-3 head does not support: MTP layers beside it (one drafter a run),
    and virtual pipeline stages (its layer hooks and gathers walk one run of layers per stage). The run's input
    check and the Megatron policy both ask this."""
    problems = []
    if mtp_num_layers:
        problems.append(f"spec.method=eagle3 trains an EAGLE-3 head; backend.megatron.mtp_num_layers={mtp_num_layers} "
                        "would build MTP layers beside it: set mtp_num_layers=0 (or use spec.method=mtp)")
    if vp > 1:
        problems.append(f"spec.method=eagle3 trains an EAGLE-3 head online, which does not run with "
                        f"backend.megatron.virtual_pipeline={vp}: set virtual_pipeline=1")
    return problems


def routing_replay_problems(recompute: str, sequence_parallel: bool, vp: int = 1) -> list[str]:
    """Megatron trainer settings MoE routing replay (`grpo.routing_replay`) does not run with: it sets each
    micro-batch's experts in the routers as its forward starts, which a recompute in the backward or a sequence
    split over tensor-parallel ranks would not see, and its routers are wired for one run of layers per stage. The
    run's input check and the Megatron policy both ask this."""
    problems = []
    if recompute != "none" or sequence_parallel:
        problems.append("grpo.routing_replay sets each micro-batch's experts in Megatron's routers as its forward "
                        "starts, which a recompute in the backward or a sequence split over tensor-parallel ranks "
                        "would not see: set backend.megatron.recompute=none and sequence_parallel=false")
    if vp > 1:
        problems.append(f"grpo.routing_replay does not run with backend.megatron.virtual_pipeline={vp}: set "
                        "virtual_pipeline=1 (or grpo.routing_replay=false)")
    return problems


def engine_problems(m: ModelConfig | None, engine: Layout, who: str = "generation") -> list[str]:
    """Every way `engine` cannot split model `m` (None: its sizes alone) as one vLLM engine: its experts live inside
    the engine (EP divides its TP), and its KV heads are split or replicated over TP."""
    problems = []
    if engine.tp % engine.ep:
        problems.append(f"{who} ep={engine.ep} must divide tp={engine.tp} (experts live inside one engine)")
    if m is not None:
        problems += layout_problems(m, engine, kv_replication=True, who=who)
    return problems


def colocation_problems(colocated: bool, engine_tp: int, *, on_gpus: bool = True, gpus_per_node: int | None = None,
                        who: str = "") -> list[str]:
    """Every way a placement's engines cannot share devices with the trainer. Colocated on GPUs, each GPU is a Ray
    bundle shared by one trainer rank and one engine worker (`placement/bundles.py`), so engines of any vLLM
    tensor parallel size run; but one engine's workers are processes of one actor, so its GPUs must lie on one
    node: tensor_parallel_size must divide the GPUs of a node (`gpus_per_node`, None: not checked). CPU bundles
    tie an engine's units in one bundle and have no such limit. The Ray placement, the launch checks and the tuner
    all ask this."""
    p = f"{who} " if who else ""
    if colocated and on_gpus and gpus_per_node and gpus_per_node % engine_tp:
        return [f"{p}colocated vLLM engines with tensor_parallel_size={engine_tp} on nodes of {gpus_per_node} GPUs: "
                "an engine's workers must share one node, so tensor_parallel_size must divide the GPUs per node; "
                "use a tensor_parallel_size that does, or backend.placement=disaggregated"]
    return []


def check_layout(m: ModelConfig | None, lay: Layout, world: int | None = None, *, kv_replication: bool = False,
                 who: str = "", runnable: bool = False, on_gpus: bool = True) -> None:
    """Raise one ValueError listing every problem of `lay` for model `m` (None: devices only) on `world` devices
    (`Layout.problems`, with `runnable` what this project does not run on GPUs, or CPUs with `on_gpus=False`, too);
    `kv_replication` checks `lay` as one
    vLLM engine's split instead."""
    if kv_replication:
        problems = engine_problems(m, lay, who=who)
    else:
        problems = lay.problems(m, world, runnable=runnable, on_gpus=on_gpus, who=who)
    if problems:
        what = f"{m.model_type} with {m.num_hidden_layers} layers" if m is not None else f"{world} devices"
        raise ValueError(f"cannot split {what} as {lay.describe()}: " + "; ".join(problems))
