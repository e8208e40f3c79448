"""The refit as the collective transport implements it, projected for a GPU cluster.

Topology (`distributed/weight_group.py`, `trainers/megatron/refit_stream.py`): one sender per trainer pipeline stage,
each holding only its own stage's weights, which the stage gathers bucket by bucket from its tensor- and
expert-parallel ranks inside its scale-up domain; every engine worker receives whole tensors (vLLM keeps its own
tensor-parallel part of each) or, sharded (`backend.refit_shard_receivers`, the default for engines of TP > 1),
only its TP rank's part of each tensor (`tp_cut`: norms, router gates and the drafter whole, k / v at one kv head
where there are fewer kv heads than TP ranks), the senders' refits at once (a bucket of each in turn); each
sender packs bucket n + 1 while bucket n travels (two buffers), so a stage costs the slower of its gather and its
send, and only the first bucket of the refit is not overlapped. Where engine and trainer are on different nodes a
receiver's bytes arrive through its own NIC. A broadcast puts each byte once on the sender's link and once on
every receiver's: each sender's link carries its own stage, each receiver's every stage's share, and the refit
takes the longer of the two. With whole tensors the receivers' links are the bound (the whole model each).
Sharded, a receiver's link carries about 1/TP of the model, while a sender's still carries its whole stage (its
TP groups' pieces add up to it, plus the replicated tensors once per extra group). Colocated on GPUs (the per-GPU CUDA IPC refit), every trainer GPU hosts one engine worker and walks the whole
model: each stage's buckets, gathered inside the stage, reach every GPU over the trainer's own group (the other
stages' through the GPU's NIC when the pipeline spans nodes), and each GPU hands them to its engine worker as an
IPC device copy.

Assumptions, printed with the result: a stage's parameters are its layers' share of the decoder plus the
embedding (first stage) and output head (last); each stage's sender receives the stage's bytes less its own
shard over NVLink (a gather over tensor and expert ranks); a sender's and a receiver's link are alike (one NIC
each); links run at `link_eff` of their spec sheet
(NCCL's broadcast of messages of hundreds of MB); loading into vLLM overlaps receiving.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware, hardware
from .shapes import CostShape


@dataclass(frozen=True)
class RefitTopology:
    """The trainer and engine layout a refit runs on."""

    tp: int
    """Trainer tensor parallel size."""
    pp: int
    """Trainer pipeline stages: the refit's senders."""
    ep: int
    """Trainer expert parallel size."""
    engines: int
    """Generation engines."""
    gen_tp: int
    """GPUs per engine: each is one receiver of whole tensors."""
    colocated: bool = False
    """Engines on the trainer's GPUs (else on GPUs, and here nodes, of their own)."""
    first_stage_layers: int = 0
    """Decoder layers of the first stage (0: an even split)."""
    last_stage_layers: int = 0
    """Decoder layers of the last stage (0: an even split)."""
    bucket_mb: int = 512
    """Refit bucket, MiB (`backend.refit_bucket_mb` on GPUs)."""
    link_eff: float = 0.9
    """Share of a link's spec-sheet bandwidth a refit's broadcasts and gathers reach."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "engines", "gen_tp", "bucket_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"refit topology: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.link_eff <= 1:
            raise ValueError(f"refit topology: link_eff must be in (0, 1], got {self.link_eff}")


def stage_layers(shape: CostShape, top: RefitTopology) -> list[int]:
    """Decoder layers per stage: the first and last as given, the rest split as evenly as whole layers allow."""
    if top.pp == 1:
        return [shape.layers]
    first, last = top.first_stage_layers, top.last_stage_layers
    inner = top.pp - 2 if first and last else top.pp - bool(first) - bool(last)
    rest = shape.layers - first - last
    if inner <= 0 or rest < inner:
        if rest != 0 or inner > 0:
            raise ValueError(f"refit topology: {shape.layers} layers cannot fill {top.pp} stages as given")
    base, extra = divmod(rest, inner) if inner else (0, 0)
    middle = [base + (i < extra) for i in range(inner)]
    return ([first] if first else []) + middle + ([last] if last else [])


def stage_bytes(shape: CostShape, top: RefitTopology, dtype_bytes: float, drafter_params: float = 0.0,
                tied: bool = False) -> list[float]:
    """Bytes each stage's sender sends: its layers' share of the decoder, the embedding and the drafter on the
    first stage, the output head (unless `tied` to the embedding) on the last."""
    layers = stage_layers(shape, top)
    head = 0.0 if tied else shape.vocab * shape.hidden
    decoder = shape.total_params - shape.embed_params - head
    out = [decoder * n / shape.layers for n in layers]
    out[0] += shape.embed_params + drafter_params
    out[-1] += head
    return [b * dtype_bytes for b in out]


@dataclass(frozen=True)
class CutShare:
    """What the sharded refit does not split by TP, per decoder layer (parameters): tensors vLLM replicates (norms,
    the MoE router gate) and the k / v projections, of which each worker takes `kv_share` (one kv head where
    there are fewer kv heads than TP ranks)."""

    whole_per_layer: float
    kv_per_layer: float
    kv_heads: int

    @classmethod
    def of(cls, cfg) -> "CutShare":
        """From a model config (`sim.config.ModelConfig`)."""
        head = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        whole = 2 * cfg.hidden_size + (2 * head if cfg.qk_norm else 0) + cfg.num_experts * cfg.hidden_size
        return cls(float(whole), float(2 * cfg.num_key_value_heads * head * cfg.hidden_size),
                   cfg.num_key_value_heads)

    def kv_share(self, tp: int) -> float:
        return max(1 / self.kv_heads, 1 / tp)


def shard_bytes(stage: float, layers: int, cut: CutShare, tp: int, dtype_bytes: float,
                whole_extra: float = 0.0) -> tuple[float, float]:
    """(bytes one receiver takes, bytes the sender puts on its link) of a stage of `stage` bytes and `layers`
    decoder layers, sharded over TP `tp`; `whole_extra`: further bytes sent whole (the drafter)."""
    whole = cut.whole_per_layer * layers * dtype_bytes + whole_extra
    kv = cut.kv_per_layer * layers * dtype_bytes
    split = stage - whole - kv
    share = cut.kv_share(tp)
    return split / tp + whole + kv * share, split + tp * (whole + kv * share)


@dataclass(frozen=True)
class RefitProjection:
    seconds: float
    stage_bytes: list[float]
    receiver_bytes: float
    sender_wire_bytes: list[float]
    receive_link: str
    receive_bw: float
    gather_bw: float
    assumptions: list[str]


def project(shape: CostShape, top: RefitTopology, hw: Hardware, dtype_bytes: float = 2.0,
            drafter_params: float = 0.0, cut: CutShare | None = None, tied: bool = False) -> RefitProjection:
    """Seconds of one refit on `top` over `hw`'s links. `cut`: the sharded refit (disaggregated engines: the
    per-GPU CUDA IPC refit of colocated ones carries whole tensors), each engine worker receiving its TP rank's
    part."""
    stages = stage_bytes(shape, top, dtype_bytes, drafter_params, tied)
    if cut is not None and top.colocated:
        raise ValueError("refit projection: the colocated (CUDA IPC) refit carries whole tensors, never sharded")
    gather_bw = hw.link_bw / 2 * top.link_eff
    copy_bw = 0.0
    if top.colocated:
        # pp > 1: a stage's GPUs fill nodes of their own, so the other stages' buckets cross the NIC
        link, bw = (("its GPU's NIC (the other stages' buckets)", hw.net_bw * top.link_eff) if top.pp > 1 else
                    ("NVLink (the stage's own buckets)", hw.link_bw / 2 * top.link_eff))
        copy_bw = hw.mem_bw / 2  # the IPC hand-over reads and writes every byte in HBM
    else:
        link, bw = "its GPU's NIC (engines on nodes of their own)", hw.net_bw * top.link_eff
    bucket = top.bucket_mb * 2**20
    own = 1 / max(top.tp, top.ep)
    if cut is None:
        recv, wire = list(stages), list(stages)
    else:
        pairs = [shard_bytes(b, n, cut, top.gen_tp, dtype_bytes, drafter_params * dtype_bytes if i == 0 else 0.0)
                 for i, (b, n) in enumerate(zip(stages, stage_layers(shape, top)))]
        recv, wire = [p[0] for p in pairs], [p[1] for p in pairs]
    per_stage, fill = [], None
    for b, r, w in zip(stages, recv, wire):
        gather, send = b * (1 - own) / gather_bw, max(r, w) / bw
        per_stage.append(max(gather, send, r / copy_bw if copy_bw else 0.0))
        if fill is None:  # the first bucket: gathered before anything is sent
            fill = min(gather, send) * min(1.0, bucket / b) if b else 0.0
    if top.colocated:  # every GPU walks the stages' buckets one stage after another
        seconds = sum(per_stage)
    else:  # the senders at once: each sender's link its own stage, each receiver's link every stage's share
        seconds = max(max(per_stage), sum(recv) / bw)
    seconds += fill or 0.0
    receiver = (f"every trainer GPU, which hands them to the engine worker on it ({top.engines} engines x "
                f"TP{top.gen_tp}) through CUDA IPC," if top.colocated else
                f"each engine worker ({top.engines} engines x TP{top.gen_tp})")
    got = ("whole tensors" if cut is None else
           f"its TP rank's part of every tensor (norms, router gates and the drafter whole, k / v "
           f"{cut.kv_share(top.gen_tp):.3g} of each)")
    assumptions = [
        f"senders: {top.pp} (one per pipeline stage), layers per stage {stage_layers(shape, top)}, "
        + ("taken in turn by every GPU" if top.colocated else "taken at once by the receivers"),
        f"{receiver} receives {got}, through {link}",
        f"links at {top.link_eff:.0%} of the spec sheet: receive {bw / 1e9:.1f} GB/s, in-stage gather over NVLink "
        f"{gather_bw / 1e9:.1f} GB/s (each sender lacks {1 - own:.0%} of its stage)",
        f"buckets of {top.bucket_mb} MiB, packing bucket n + 1 while bucket n travels; loading overlaps receiving",
    ]
    return RefitProjection(seconds, stages, sum(recv), wire, link, bw, gather_bw, assumptions)


def refit_report(model: str, top: RefitTopology, hw_name: str = "h100", fp8: bool = False,
                 drafter_params: float = 0.0) -> str:
    """The refit of `model` on `top`: seconds with whole tensors and sharded (the default for disaggregated engines
    of TP > 1)."""
    from .config import resolve_model
    from .shapes import shape_of

    cfg = resolve_model(model)
    shape, hw, tied = shape_of(cfg), hardware(hw_name), cfg.tie_word_embeddings
    dtype_bytes = 1 if fp8 else 2
    now = project(shape, top, hw, dtype_bytes, drafter_params, tied=tied)
    lines = [f"refit of {model} on {hw.name}: TP{top.tp} x PP{top.pp} x EP{top.ep} trainer -> {top.engines} engines "
             f"of TP{top.gen_tp} ({'colocated' if top.colocated else 'disaggregated'}), "
             f"{'fp8' if fp8 else 'bf16'} weights",
             *(f"  assumption: {a}" for a in now.assumptions),
             f"  stage bytes (GB): {' '.join(f'{b / 1e9:.1f}' for b in now.stage_bytes)}; busiest sender "
             f"{max(now.stage_bytes) / 1e9:.1f} GB, each receiver {now.receiver_bytes / 1e9:.1f} GB",
             f"  refit with whole tensors: {now.seconds:.1f} s"]
    if top.colocated or top.gen_tp == 1:
        lines[-1] += " (as implemented: " + ("the CUDA IPC refit is never sharded)" if top.colocated else "TP1)")
        return "\n".join(lines)
    cut = CutShare.of(cfg)
    shard = project(shape, top, hw, dtype_bytes, drafter_params, cut=cut, tied=tied)
    lines += [f"  assumption: sharded, {shard.assumptions[1]}",
              f"  refit sharded (backend.refit_shard_receivers, as implemented): {shard.seconds:.1f} s, each "
              f"receiver {shard.receiver_bytes / 1e9:.1f} GB, busiest sender's link "
              f"{max(shard.sender_wire_bytes) / 1e9:.1f} GB"]
    return "\n".join(lines)
