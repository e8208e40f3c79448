"""Which part of an HF tensor vLLM's tensor-parallel loader keeps on TP rank r, so a refit can send each engine
worker only that part (`distributed/weight_group.py`, sharded mode) instead of the whole tensor.

The rule mirrors vLLM's loaders for Qwen3 / Llama-style dense and MoE models (no vLLM import: it runs in trainer
processes):

- `q_proj` (QKVParallelLinear, q): dim 0, heads / TP heads per rank.
- `k_proj`, `v_proj`: dim 0, kv_heads / TP heads per rank; with fewer kv heads than TP ranks each head serves
  TP / kv_heads consecutive ranks (vLLM's kv-head replicas), so rank r takes head r // (TP / kv_heads).
- `gate_proj`, `up_proj` (MergedColumnParallelLinear, and the experts' w1 / w3): dim 0, `size // TP` rows from
  `r * (size // TP)`, clipped at the end (the fused-MoE loader's rule; for the dense layer, where vLLM requires
  divisibility, the same cut).
- `o_proj`, `down_proj` (RowParallelLinear, experts' w2): dim 1, likewise; their biases are whole (vLLM adds a
  row-parallel bias once, unsharded).
- `embed_tokens`, `lm_head` (VocabParallelEmbedding / ParallelLMHead): vocab rows; the vocabulary is padded to a
  multiple of 64, cut into TP equal ranges, and rank r reads the original rows of its range
  [r * per, min((r + 1) * per, vocab)) (possibly none).
- Everything else (norms, the MoE router gate, drafter tensors under `DRAFTER_PREFIX`) is whole: vLLM replicates
  it, or (the drafter) converts it before loading, so its cut would not be this rule's.

`megatron_spec_trial_refit` checks the rule against the running engine at start-up, so a model this rule gets
wrong fails before a run instead of loading garbage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .refit import DRAFTER_PREFIX

VOCAB_PADDING = 64
"""vLLM's vocabulary padding (`DEFAULT_VOCAB_PADDING_SIZE`) before it cuts the embedding and head over TP."""

_HEADS_Q = re.compile(r"\.q_proj\.(weight|bias)$")
_HEADS_KV = re.compile(r"\.[kv]_proj\.(weight|bias)$")
_COLUMN = re.compile(r"\.(gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
"""The embedding and the output head: cut by vocabulary rows."""


@dataclass(frozen=True)
class Geometry:
    """What the cut needs of the model and the engine: TP size, attention heads and kv heads."""

    tp: int
    heads: int
    kv_heads: int

    def __post_init__(self):
        if self.tp < 1 or self.heads < 1 or self.kv_heads < 1:
            raise ValueError(f"tensor-parallel cut: tp, heads and kv_heads must be >= 1, got {self}")
        if self.heads % self.tp:
            raise ValueError(f"tensor-parallel cut: {self.heads} attention heads do not split over TP {self.tp}")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:
            raise ValueError(f"tensor-parallel cut: {self.kv_heads} kv heads neither split over nor replicate "
                             f"evenly on TP {self.tp}")

    @classmethod
    def of(cls, hf_config: dict, tp: int) -> "Geometry":
        """From an HF config (a dict, e.g. config.json's) and the engine's TP size."""
        heads = hf_config["num_attention_heads"]
        return cls(tp, heads, hf_config.get("num_key_value_heads") or heads)

    def as_dict(self) -> dict:
        return {"tp": self.tp, "heads": self.heads, "kv_heads": self.kv_heads}


def _even(size: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s `size // tp` elements, clipped at `size`."""
    per = size // tp
    start = min(per * rank, size)
    return start, min(per, size - start)


def cut(name: str, shape: tuple[int, ...], geo: Geometry, rank: int) -> tuple[int, int, int] | None:
    """The (dim, start, length) of tensor `name` (HF naming, of `shape`) that TP rank `rank` loads, or None when
    the rank loads it whole."""
    if not 0 <= rank < geo.tp:
        raise ValueError(f"tensor-parallel cut: rank {rank} of TP {geo.tp}")
    if geo.tp == 1 or name.startswith(DRAFTER_PREFIX) or not shape:
        return None
    if _HEADS_Q.search(name):
        return (0, *_even(shape[0], geo.tp, rank))
    if _HEADS_KV.search(name):
        if geo.kv_heads >= geo.tp:
            return (0, *_even(shape[0], geo.tp, rank))
        head = shape[0] // geo.kv_heads
        return 0, rank // (geo.tp // geo.kv_heads) * head, head
    if _COLUMN.search(name):
        return (0, *_even(shape[0], geo.tp, rank))
    if _ROW.search(name) and len(shape) == 2:
        return (1, *_even(shape[1], geo.tp, rank))
    if VOCAB.search(name):
        vocab = shape[0]
        per = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // geo.tp
        start = min(rank * per, vocab)
        return 0, start, min((rank + 1) * per, vocab) - start
    return None


def rebuild(full_shape, dim: int, start: int, piece, fill: float | None = None):
    """A tensor of `full_shape` holding `piece` at `start` along `dim` (what vLLM's loader narrows to), the rest
    left uninitialised (on CPU untouched pages cost no memory), or `fill` (the trial's NaN)."""
    import torch

    full = torch.empty(full_shape, dtype=piece.dtype, device=piece.device)
    if fill is not None:
        full.fill_(fill)
    full.narrow(dim, start, piece.shape[dim]).copy_(piece)
    return full
