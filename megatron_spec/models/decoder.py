"""The decoder-only language model shared by Qwen3, Qwen3-MoE and Llama.

Reads top to bottom: embed -> N x (attention, MLP or MoE, both pre-norm residual) -> final norm -> output head.
`trunk()` returns the hidden states (and any intermediate layers a drafter asks for); `forward()` adds the head.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import kernels
from .config import ModelConfig
from .kv_cache import BatchView
from .layers import MLP, Attention, AttentionCache, MoE, RMSNorm, rotary
from .packed import kernel_rows, packed, registrations


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random init (normal(0, std) matrices, unit norms, zero biases), deterministic under torch.manual_seed.
    Shared by the model and its drafter heads, so a fresh head starts at the trunk's scale."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=std)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache | None) -> Tensor:
        if isinstance(cache, BatchView) and self.one_kernel(x):
            return self.fused(x, cos, sin, cache)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def projections(self) -> tuple[tuple[nn.Linear, ...], ...]:
        attn, mlp = self.self_attn, self.mlp
        return (attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)

    def one_kernel(self, x: Tensor) -> bool:
        """Whether the engine's forward of `x` may run as `fused`: the kernels take it (CPU, inference mode, the
        layer's dtype) and it has at most the plan's rows (`fused_rows`)."""
        # The MLP check first: an MoE layer never fuses, and its plan's key would read every expert's weights.
        return isinstance(self.mlp, MLP) and self.plan().takes(x)

    def plan(self) -> FusedPlan:
        """This layer's `FusedPlan`, rebuilt when any of its parameters changed (`params_key`)."""
        return current_plan(FUSED_PLANS, self, FusedPlan.of)

    def fused(self, x: Tensor, cos: Tensor, sin: Tensor, cache: BatchView) -> Tensor:
        """This layer in one kernel call (`kernels.decoder_layer`): the kernels its modules' forwards call up to the
        linear's row bound, in the same order, so the same bits there, without the ~20 torch ops and Python calls
        between them (at a batch of one those cost about a quarter of a SmolLM2 step on 2 cores). Past that bound
        (small layers, `FUSED_LAYER_MACS`) the modules would take oneDNN's GEMMs; the kernels still compute each
        row alone, so a token's numbers stay the same in a batch of any size up to the plan's rows."""
        plan = FUSED_PLANS[self]
        return kernels.decoder_layer(x, cos, sin, *plan.weights, *cache.layer_cache(plan.cache_layer), cache.slots,
                                     cache.positions, *plan.heads)


@dataclass
class FusedPlan:
    """What `DecoderLayer.fused` hands the kernel, worked out once per change of the layer's weights rather than on
    every forward: finding the layer's packs through its modules' attributes and checking each group's kernel
    conditions cost ~80 us a layer on the main job's tiny model, about as much as the fused kernel itself (its
    8-layer trunk at B=1: 1.54 ms a forward with them, 0.89 ms with the plan, in one process, alternating)."""

    params: tuple[Tensor, ...]
    """The layer's parameters when the plan was made."""
    key: tuple
    """Their `params_key` then: any in-place update (optimizer step, refit), new storage or re-assigned parameter
    changes it, and the plan is made again."""
    dtype: torch.dtype
    max_rows: int
    """The most input rows (B x T) the fused path takes (`fused_rows`, read when the plan is made); 0 where it never
    applies (an MoE layer, weights off the CPU, inference tensors or of mixed dtypes)."""
    weights: tuple
    """`kernels.decoder_layer`'s arguments from the norms to the MLP's down projection."""
    cache_layer: int = 0
    """The KV-cache layer its attention reads and writes."""
    heads: tuple = ()
    """(query heads, KV heads) of its attention."""
    checked: int = field(default=0, kw_only=True)
    """The `weights_fixed` block in which the key was last found current (0: none)."""

    def takes(self, x: Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_rows * x.shape[-1] and kernels.usable(x)

    @classmethod
    def of(cls, layer: DecoderLayer) -> FusedPlan:
        params = tuple(layer.parameters())
        dtype, weights, max_rows = params[0].dtype, (), 0
        # CPU weights only: the kernel and the packs (oneDNN's reorder) exist for the CPU alone, and a plan made for
        # a layer on the GPU must not pack at all (the GPU tier found a plan that called oneDNN on CUDA weights).
        if isinstance(layer.mlp, MLP) and all(p.dtype == dtype and p.device.type == "cpu" for p in params) \
                and not any(p.is_inference() for p in params):
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv, o, gate_up, down = (packed(group) for group in layer.projections())
            q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
            weights = ((norm.weight, layer.post_attention_layernorm.weight), norm.eps, (qkv.plain, qkv.bias),
                       (o.plain, o.bias), (q_norm, k_norm), 0.0 if attn.q_norm is None else attn.q_norm.eps,
                       gate_up.plain, down.plain)
            max_rows = fused_rows(layer.projections())
        attn = layer.self_attn
        return cls(params, params_key(params), dtype, max_rows, weights, attn.layer, (attn.n_heads, attn.n_kv))


FUSED_LAYER_MACS = 1 << 25
"""The fused layer takes inputs of up to this many multiply-adds in its projections (rows x MACs a row), also past the
kernels' linear's own row bound (`packed.kernel_rows`): on a small layer, the ~20 torch ops and Python calls between
the modules' kernels cost more than oneDNN's faster GEMMs save. On a 2-thread AVX2 EPYC the fused layer is faster
than the modules' path on the main job's deep tiny model (107 K MACs a row; this bound: 312 rows) up to about 256
rows and slower from 320, and on tiny-qwen3 (197 K, 170 rows) about even at 192: the bound sits near that
crossing. SmolLM2's layers (3.5 M MACs a row) keep the linear's bound."""


def fused_rows(groups: tuple[tuple[nn.Linear, ...], ...]) -> int:
    """The most input rows the fused layer over projection `groups` takes: 0 where a group has no kernel linear,
    else the linear's row bound or FUSED_LAYER_MACS' worth of rows, whichever is more."""
    bound = min(kernel_rows(group) for group in groups)
    macs = sum(m.in_features * m.out_features for group in groups for m in group)
    return max(bound, FUSED_LAYER_MACS // macs) if bound else 0


FUSED_PLANS: weakref.WeakKeyDictionary[DecoderLayer, FusedPlan] = weakref.WeakKeyDictionary()
"""Plans by layer, kept beside the layers (as `packed.PACKS` is) so a model still deep-copies and pickles."""


def params_key(params: tuple[Tensor, ...]) -> tuple:
    return (registrations(), *[(p.data_ptr(), p._version) for p in params])


def current_plan(plans: weakref.WeakKeyDictionary, module: nn.Module, make):
    """`plans[module]` (a `FusedPlan` or one built on it), made again by `make(module)` when it is missing or any of
    the parameters it was made from changed since (`params_key`); inside a `weights_fixed` block, checked once."""
    plan = plans.get(module)
    if plan is not None and _fixed[0] and plan.checked == _fixed[1]:
        return plan
    if plan is None or plan.key != params_key(plan.params):
        plan = plans[module] = make(module)
    plan.checked = _fixed[1] if _fixed[0] else 0
    return plan


_fixed = [0, 0]
"""Depth of the `weights_fixed` blocks being run, and the outermost one's number (from 1)."""


@contextlib.contextmanager
def weights_fixed():
    """Declares that no parameter changes while the block runs, so a plan found current once in it is not checked
    again: the engine's `generate`, whose model and drafter change only between its calls (refits, optimizer
    steps). Checking on every forward reads every parameter's storage and version, ~7 us a layer: the main job's
    plain decoding runs 1.08x / 1.05x / 1.02x faster at B = 1 / 8 / 64 with the block, SmolLM2's (30 larger
    layers) 1.00x (`research/weights_fixed.py`)."""
    if not _fixed[0]:
        _fixed[1] += 1
    _fixed[0] += 1
    try:
        yield
    finally:
        _fixed[0] -= 1


@dataclass
class TrunkOutput:
    hidden: Tensor
    """Final hidden states after the last norm, [B, T, H]: what the output head reads."""
    layers: dict[int, Tensor] = field(default_factory=dict)
    """Residual stream after each requested layer index (EAGLE-3 fuses low/middle/high ones)."""
    routing: Tensor | None = None
    """[B, T, MoE layers, top_k] the experts each position was routed to, where the caller read them
    (`routing.choices`: the engine, recording a rollout's routing); None otherwise."""


class Transformer(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        init_weights(self, std)

    @property
    def aux_loss(self) -> Tensor | None:
        """Sum over MoE layers of the load-balancing loss of the last forward; None for dense models."""
        losses = [m.mlp.aux_loss for m in self.model.layers if isinstance(m.mlp, MoE) and m.mlp.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def trunk(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache: AttentionCache | None = None,
        capture: tuple[int, ...] = (),
        inputs_embeds: Tensor | None = None,
    ) -> TrunkOutput:
        """Hidden states for `input_ids` [B, T] at `positions` [B, T] (default 0..T-1), through `cache` if given."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta, x.dtype, cache)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache)
            if i in capture:
                captured[i] = x
        return TrunkOutput(self.model.norm(x), captured)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, cache: AttentionCache | None = None) -> Tensor:
        """Logits [B, T, V] for every input position."""
        return self.lm_head(self.trunk(input_ids, positions, cache).hidden)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype
