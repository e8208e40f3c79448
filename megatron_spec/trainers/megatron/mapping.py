"""Names and layouts, HF <-> Megatron-Core, for one parameter. Pure functions: no megatron-core, no process group.

A Megatron parameter on one rank is a shard of a *full Megatron tensor*; the full tensor is made of one or more
HF tensors:

    kind        full Megatron tensor                          split over ranks
    replicated  the HF tensor (norms, router)                 not split
    column      the HF tensor (eh_proj)                       dim 0 over TP
    row         the HF tensor (o_proj, down_proj)             dim 1 over TP (experts: over ETP)
    vocab       embed / lm_head padded with zero rows         dim 0 over TP
    qkv         per query group g: [q heads of g; k_g; v_g]   dim 0 over TP (whole groups per rank)
    fc1         per rank r: [gate chunk r; up chunk r]        dim 0 over TP (experts: over ETP)

Experts live on EP rank `e // (E / EP)` as local expert `e % (E / EP)`. Decoder layers carry global numbers in HF
names; Megatron numbers them per pipeline stage, so callers pass the stage's first global layer (`layer_offset`).
MTP layers map to our drafter's names (`megatron_spec.drafters.mtp.model`): `mtp.layers.{i}.{enorm,hnorm,eh_proj,
final_layernorm}` and `mtp.layers.{i}.transformer_layer.<decoder-layer names>`; `vllm_mtp_name` renames those
for vLLM's Qwen3-Next / Qwen3.5 MTP drafters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_spec.models import CausalLM, ModelConfig
from megatron_spec.models.decoder import DecoderLayer

REPLICATED, COLUMN, ROW, VOCAB, QKV, FC1 = "replicated", "column", "row", "vocab", "qkv", "fc1"
SPLIT_DIM = {REPLICATED: None, COLUMN: 0, ROW: 1, VOCAB: 0, QKV: 0, FC1: 0}


@dataclass(frozen=True)
class ParamSpec:
    """What one Megatron parameter holds, in HF terms."""

    kind: str
    """One of REPLICATED, COLUMN, ROW, VOCAB, QKV, FC1 (see the module docstring)."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of: 3 for qkv (q, k, v), 2 for fc1 (gate, up), else 1. Expert names hold `{expert}`."""
    local_expert: int | None = None
    """Index among this rank's experts; the global id is `ep_rank * experts_per_rank + local_expert`."""
    export: bool = True
    """False for copies that another stage exports (the MTP stage's embedding, a tied output layer)."""

    @property
    def is_expert(self) -> bool:
        return self.local_expert is not None

    def names(self, global_expert: int | None = None) -> tuple[str, ...]:
        """HF names with the expert id filled in."""
        if self.is_expert:
            if global_expert is None:
                raise ValueError(f"expert parameter {self.hf_names} needs its global expert id")
            return tuple(n.format(expert=global_expert) for n in self.hf_names)
        return self.hf_names


# ---------------------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_INNER = re.compile(r"^(?:transformer_layer|mtp_model_layer)\.(.+)$")  # 0.16 / 0.19 spelling
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")  # TEGroupedMLP

# Inside one decoder layer: Megatron suffix -> (kind, HF suffixes). TE fuses the pre-attention and pre-MLP norms
# into the next linear (`layer_norm_weight`); the local spec keeps them as modules.
_LAYER_PARAMS = {
    "input_layernorm.weight": (REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (QKV, tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.q_layernorm.weight": (REPLICATED, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": (REPLICATED, ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": (ROW, ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": (REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": (FC1, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": (ROW, ("mlp.down_proj.weight",)),
    "mlp.router.weight": (REPLICATED, ("mlp.gate.weight",)),
}
_EXPERT_PARAMS = {
    "linear_fc1": (FC1, ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight")),
    "linear_fc2": (ROW, ("mlp.experts.{expert}.down_proj.weight",)),
}
_MTP_PARAMS = {
    "enorm.weight": (REPLICATED, "enorm.weight"),
    "hnorm.weight": (REPLICATED, "hnorm.weight"),
    "eh_proj.weight": (COLUMN, "eh_proj.weight"),
    "final_layernorm.weight": (REPLICATED, "final_layernorm.weight"),
}


def _layer_param(rest: str, prefix: str, megatron_name: str) -> ParamSpec:
    if rest in _LAYER_PARAMS:
        kind, suffixes = _LAYER_PARAMS[rest]
        return ParamSpec(kind, tuple(prefix + s for s in suffixes))
    m = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    if m:
        local, linear = (int(m[1]), m[2]) if m.re is _LOCAL_EXPERT else (int(m[2]), m[1])
        kind, suffixes = _EXPERT_PARAMS[linear]
        return ParamSpec(kind, tuple(prefix + s for s in suffixes), local_expert=local)
    raise ValueError(f"no HF name for Megatron parameter {megatron_name!r} (unknown decoder-layer part {rest!r})")


def megatron_to_hf(name: str, layer_offset: int = 0, *, first_stage: bool = True, tied: bool = False) -> ParamSpec:
    """The `ParamSpec` of Megatron parameter `name` on a pipeline stage whose first decoder layer is `layer_offset`.

    `first_stage`: whether this stage owns the input embedding (later stages hold copies: MTP, tied heads).
    `tied`: the model ties the output head to the embedding, so `output_layer.weight` is a copy of it.
    """
    if name == "embedding.word_embeddings.weight":
        return ParamSpec(VOCAB, ("model.embed_tokens.weight",), export=first_stage)
    if name == "output_layer.weight":
        if tied:
            return ParamSpec(VOCAB, ("model.embed_tokens.weight",), export=False)
        return ParamSpec(VOCAB, ("lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamSpec(REPLICATED, ("model.norm.weight",))
    m = _LAYER.match(name)
    if m:
        return _layer_param(m[2], f"model.layers.{layer_offset + int(m[1])}.", name)
    m = _MTP.match(name)
    if m:
        depth, rest = int(m[1]), m[2]
        if rest in _MTP_PARAMS:
            kind, suffix = _MTP_PARAMS[rest]
            return ParamSpec(kind, (f"mtp.layers.{depth}.{suffix}",))
        inner = _MTP_INNER.match(rest)
        if inner:
            return _layer_param(inner[1], f"mtp.layers.{depth}.transformer_layer.", name)
    raise ValueError(f"no HF name for Megatron parameter {name!r}")


def vllm_mtp_name(name: str) -> str:
    """Rename one of our HF names for vLLM's Qwen3-Next / Qwen3.5 MTP drafters (`Qwen3NextMTP.load_weights`).

    Trunk names are unchanged; `mtp.layers.0.{enorm,hnorm,eh_proj,final_layernorm}` become
    `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}` and `mtp.layers.{i}.transformer_layer.X` becomes
    `mtp.layers.{i}.X`. vLLM's class has one fc and one set of norms, so only depth 0 may carry them.
    """
    m = _MTP.match(name)
    if not m:
        return name
    depth, rest = int(m[1]), m[2]
    heads = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
             "eh_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight"}
    if rest in heads:
        if depth != 0:
            raise ValueError(
                f"{name}: vLLM's Qwen3-Next-style MTP shares one fc and one set of norms across depths, "
                "so it can only load an MTP block with one layer"
            )
        return f"mtp.{heads[rest]}"
    if rest.startswith("transformer_layer."):
        return f"mtp.layers.{depth}.{rest[len('transformer_layer.'):]}"
    raise ValueError(f"{name} is not an MTP drafter tensor name")


def is_norm_name(name: str) -> bool:
    """Whether an HF name is an RMSNorm weight."""
    return name.endswith("norm.weight")


def rename_for_vllm(
    items: Iterable[tuple[str, Tensor]], zero_centered_mtp_norms: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """An export stream with the drafter renamed for vLLM's Qwen3-Next / Qwen3.5 MTP (`vllm_mtp_name`).

    `zero_centered_mtp_norms`: those vLLM classes compute `x * (1 + w)` (Gemma-style RMSNorm), so their
    checkpoints store `w - 1`; set it when loading into the stock classes.
    """
    for name, t in items:
        if zero_centered_mtp_norms and name.startswith("mtp.") and is_norm_name(name):
            t = t - 1
        yield vllm_mtp_name(name), t


def expected_hf_names(cfg: ModelConfig, mtp_num_layers: int = 0) -> set[str]:
    """Every HF tensor name of the policy plus `mtp_num_layers` MTP layers (no lm_head when tied).

    The MTP layer's MLP mirrors the last decoder layer (dense or MoE), as Megatron-Core builds it.
    """
    with torch.device("meta"):
        names = set(CausalLM(cfg).state_dict())
        layer = set(DecoderLayer(cfg, cfg.num_hidden_layers - 1).state_dict())
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")
    for i in range(mtp_num_layers):
        names |= {f"mtp.layers.{i}.{s}" for s in _MTP_PARAMS}
        names |= {f"mtp.layers.{i}.transformer_layer.{s}" for s in layer}
    return names


# ---------------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Rows of Megatron's embedding: `vocab_size` rounded up to a multiple of `divisible_by * tp` (Megatron-LM's rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab(t: Tensor, padded: int) -> Tensor:
    if t.shape[0] > padded:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit in {padded} padded rows")
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if t.shape[0] < padded else t


def trim_vocab(t: Tensor, vocab_size: int) -> Tensor:
    return t[:vocab_size]


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, num_query_groups: int) -> Tensor:
    """HF q/k/v projections -> Megatron's `linear_qkv`: per query group, that group's query heads then its k and v."""
    g = num_query_groups
    parts = [t.reshape(g, t.shape[0] // g, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `merge_qkv`."""
    g, per_group = num_query_groups, num_heads // num_query_groups
    grouped = qkv.reshape(g, (per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def merge_fc1(gate: Tensor, up: Tensor, tp: int) -> Tensor:
    """HF gate/up -> the concatenation of Megatron's `linear_fc1` shards: rank r holds [gate chunk r; up chunk r]."""
    return torch.cat([torch.cat([g, u]) for g, u in zip(_chunks(gate, tp, 0), _chunks(up, tp, 0))])


def split_fc1(fc1: Tensor, tp: int) -> tuple[Tensor, Tensor]:
    """Inverse of `merge_fc1`: the gathered `linear_fc1` of `tp` ranks -> (gate, up)."""
    if tp == 1:
        return tuple(fc1.chunk(2, dim=0))  # views, no copy
    halves = [s.chunk(2, dim=0) for s in _chunks(fc1, tp, 0)]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def to_megatron(spec: ParamSpec, hf: tuple[Tensor, ...], cfg: ModelConfig, tp: int, padded_vocab: int) -> Tensor:
    """Full Megatron tensor from the HF tensors of `spec` (`tp`: the size it is split over; ETP for experts)."""
    if spec.kind == QKV:
        return merge_qkv(*hf, cfg.num_key_value_heads)
    if spec.kind == FC1:
        return merge_fc1(*hf, tp)
    if spec.kind == VOCAB:
        return pad_vocab(hf[0], padded_vocab)
    return hf[0]


def from_megatron(spec: ParamSpec, full: Tensor, cfg: ModelConfig, tp: int) -> tuple[Tensor, ...]:
    """HF tensors of `spec` from its full (gathered) Megatron tensor; inverse of `to_megatron`."""
    if spec.kind == QKV:
        return split_qkv(full, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    if spec.kind == FC1:
        return split_fc1(full, tp)
    if spec.kind == VOCAB:
        return (trim_vocab(full, cfg.vocab_size),)
    return (full,)


def from_megatron_shards(spec: ParamSpec, shards: list[Tensor], cfg: ModelConfig) -> tuple[Tensor, ...]:
    """HF tensors straight from all ranks' shards (rank order): `from_megatron(unshard(...))` with one copy, not two."""
    tp = len(shards)
    if tp == 1 or SPLIT_DIM[spec.kind] is None:
        return from_megatron(spec, shards[0], cfg, tp)
    if spec.kind == QKV:  # each shard holds whole query groups
        parts = [split_qkv(s, cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, cfg.head_dim) for s in shards]
        return tuple(torch.cat(p) for p in zip(*parts))
    if spec.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    return from_megatron(spec, unshard(spec, shards), cfg, tp)


def shard(spec: ParamSpec, full: Tensor, tp: int, rank: int) -> Tensor:
    """This rank's part of a full Megatron tensor."""
    dim = SPLIT_DIM[spec.kind]
    return full if dim is None or tp == 1 else _chunks(full, tp, dim)[rank]


def unshard(spec: ParamSpec, shards: list[Tensor]) -> Tensor:
    """The full Megatron tensor from all ranks' shards (in rank order)."""
    dim = SPLIT_DIM[spec.kind]
    return shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim=dim)


def _chunks(t: Tensor, n: int, dim: int) -> tuple[Tensor, ...]:
    if t.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of a {tuple(t.shape)} tensor into {n} equal parts")
    return t.chunk(n, dim=dim)


# ---------------------------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------------------------


def expert_owner(global_expert: int, num_experts: int, ep: int) -> tuple[int, int]:
    """(EP rank, local index) of a global expert id."""
    if num_experts % ep:
        raise ValueError(f"EP={ep} does not divide num_experts={num_experts}")
    per_rank = num_experts // ep
    return global_expert // per_rank, global_expert % per_rank


def global_expert(local_expert: int, ep_rank: int, num_experts: int, ep: int) -> int:
    """Global id of this EP rank's `local_expert`."""
    return ep_rank * (num_experts // ep) + local_expert
