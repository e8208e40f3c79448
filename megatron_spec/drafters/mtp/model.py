"""Multi-token prediction (MTP) drafter in Megatron-Core's layout (DeepSeek-V3 style), weights and forward only.

Depth i turns a hidden state at position t and the embedding of the token i+1 places ahead into a prediction of
the token one place further:

    x = eh_proj(cat[enorm(embed(token)), hnorm(h_prev)])    # embedding half first, as Megatron-Core concatenates
    h = final_layernorm(transformer_layer(x))               # one decoder layer of the trunk's kind
    logits = lm_head(h)                                     # the target's shared head

Which hidden state feeds depth 0: Megatron-Core's `GPTModel._postprocess` hands the MTP block the output of
`self.decoder`, and `TransformerBlock` applies its `final_layernorm` before returning, so depth 0 reads the trunk's
hidden state *after* the final norm, i.e. `CausalLM.trunk(...).hidden`. Every depth returns its state after its own
`final_layernorm`, and that normed state is both what the head reads and what the next depth takes as `h_prev`
(`MultiTokenPredictionBlock.forward` chains the layer outputs).

RoPE: Megatron-Core rolls the token ids for each depth but passes the trunk's rotary embedding unchanged, so the
transformer layer at depth i rotates by the position t of the hidden state it reads (not of the token). Callers pass
those positions; `forward_all` does it for a full teacher-forced sequence.

The embedding and the head belong to the target: they are passed in, never saved with the drafter, and read
through `.detach()` so a drafter loss can never move the policy (only the RL loss trains it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import kernels
from ...models.config import ModelConfig
from ...models.decoder import CausalLM, DecoderLayer, FusedPlan, current_plan, init_weights, params_key
from ...models.kv_cache import BatchView
from ...models.layers import AttentionCache, RMSNorm, rope_table, rotary
from ...models.packed import kernel_rows, kernel_takes, linears, packable, packed

Embed = Callable[[Tensor], Tensor]
"""Token ids [B, T] -> the target's embeddings [B, T, H] (`CausalLM.embed`)."""


@dataclass
class MTPConfig:
    num_layers: int = 1
    """MTP depths; depth i predicts the token i+2 places after the hidden state's position. A proposer that drafts
    more tokens than this re-applies the last depth."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"MTPConfig.num_layers must be >= 1, got {self.num_layers}")


class MTPLayer(nn.Module):
    """One MTP depth: norms, the [embedding, hidden] projection, a decoder layer and its own final norm."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        # Built as a copy of the trunk's last layer so it is dense or MoE exactly like that layer (building it with
        # index N + depth could flip the kind under `decoder_sparse_step` / `mlp_only_layers`), then its attention
        # is pointed at cache layer N + depth so its keys/values live in an extra layer of the engine's KV cache.
        self.transformer_layer = DecoderLayer(cfg, cfg.num_hidden_layers - 1)
        self.transformer_layer.self_attn.layer = cfg.num_hidden_layers + depth
        self.final_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(
        self, hidden: Tensor, token_embeds: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache | None
    ) -> Tensor:
        if isinstance(cache, BatchView) and self.one_kernel(hidden):
            return self.fused(hidden, token_embeds, cos, sin, cache)
        return self.final_layernorm(self.transformer_layer(self.joined(hidden, token_embeds), cos, sin, cache))

    def joined(self, hidden: Tensor, token_embeds: Tensor) -> Tensor:
        """eh_proj([enorm(embeds), hnorm(hidden)]): the decoder layer's input."""
        # `linears`: packed for the engine's drafting, where an nn.Linear call cost ~50 us a draft on the main job's
        # tiny head (as much as its whole decoder layer); F.linear, with gradients, anywhere else.
        return linears(torch.cat((self.enorm(token_embeds), self.hnorm(hidden)), dim=-1), self.eh_proj)[0]

    def store(self, hidden: Tensor, token_embeds: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache) -> None:
        """Only the keys and values `forward` writes into `cache` (`Attention.store`): a one-layer depth's keys at a
        position depend on that position's inputs alone, so they need neither the attention nor the MLP."""
        layer = self.transformer_layer
        layer.self_attn.store(layer.input_layernorm(self.joined(hidden, token_embeds)), cos, sin, cache)

    def one_kernel(self, x: Tensor) -> bool:
        """Whether the engine's drafting may run this depth as `fused`: its decoder layer fuses `x`'s rows, the
        projection has a kernel linear and every weight has `x`'s dtype (`MTPPlan`)."""
        return self.plan().takes(x)

    def plan(self) -> MTPPlan:
        """This depth's `MTPPlan`, made again when any of its parameters changed (as `DecoderLayer.plan`)."""
        return current_plan(MTP_PLANS, self, MTPPlan.of)

    def fused(self, hidden: Tensor, token_embeds: Tensor, cos: Tensor, sin: Tensor, cache: BatchView) -> Tensor:
        """This depth in one kernel call (`kernels.mtp_layer`): the kernels its modules call, in their order, so
        the same bits wherever they would take the kernels' linear, without the ~10 Python calls and torch ops
        around the decoder layer (on the main job's tiny head those cost more than the layer: a drafting round at
        B=1 took ~0.56 ms, its decoder layer ~0.07 ms)."""
        plan = MTP_PLANS[self]
        return kernels.mtp_layer(hidden, token_embeds, *plan.head_args, cos, sin, plan.weights,
                                 *cache.layer_cache(plan.cache_layer), cache.slots, cache.positions, *plan.heads)


@dataclass
class MTPPlan(FusedPlan):
    """What `MTPLayer.fused` hands the kernel, worked out once per change of the depth's weights: finding them
    through the modules and checking the kernel's conditions on every drafting round cost ~28 us of a ~340 us round
    on the main job's tiny head at B=4 (nn.Module attribute lookups, the decoder layer's plan, dtype checks).

    A `FusedPlan` of the whole depth: `params` / `key` are the depth's, `max_rows` is its decoder layer's (0 where the
    layer does not fuse, the projection has no kernel linear, or the weights' dtypes differ), `weights` are its
    decoder layer's `FusedPlan.weights`, and so are `cache_layer` and `heads`."""

    head_args: tuple = ()
    """`kernels.mtp_layer`'s arguments from the norms to the final norm's eps."""

    @classmethod
    def of(cls, depth: MTPLayer) -> MTPPlan:
        params = tuple(depth.parameters())
        key, dtype = params_key(params), params[0].dtype
        layer, own = depth.transformer_layer.plan(), (depth.enorm, depth.hnorm, depth.eh_proj, depth.final_layernorm)
        if not layer.max_rows or kernel_rows((depth.eh_proj,)) == 0 or any(m.weight.dtype != dtype for m in own):
            return cls(params, key, dtype, 0, ())
        head_args = ((depth.enorm.weight, depth.hnorm.weight), depth.enorm.eps, depth.eh_proj.weight,
                     depth.final_layernorm.weight, depth.final_layernorm.eps)
        return cls(params, key, dtype, layer.max_rows, layer.weights, layer.cache_layer, layer.heads, head_args)


MTP_PLANS: weakref.WeakKeyDictionary[MTPLayer, MTPPlan] = weakref.WeakKeyDictionary()
"""Plans by MTP depth, kept beside the modules (as `decoder.FUSED_PLANS`)."""


class MTP(nn.Module):
    """`num_layers` MTP depths for a target `ModelConfig`; names match Megatron-Core (`mtp.layers.{i}.*`)."""

    def __init__(self, target_config: ModelConfig, mtp_config: MTPConfig | None = None):
        super().__init__()
        # Not called `config`: hf_io.check_state reads `module.config.tie_word_embeddings` as "the module's own head
        # is tied", which is the target's business, not the drafter's.
        self.target_config = target_config
        self.mtp_config = mtp_config or MTPConfig()
        # Nested as `mtp.layers` so state-dict names equal Megatron-Core's GPTModel (`self.mtp.layers.{i}`).
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList(MTPLayer(target_config, i) for i in range(self.mtp_config.num_layers))
        self.reset_parameters()

    @property
    def layers(self) -> nn.ModuleList:
        return self.mtp.layers

    @property
    def num_cache_layers(self) -> int:
        """Extra KV-cache layers (after the target's) this drafter writes: one per depth."""
        return self.mtp_config.num_layers

    def reset_parameters(self, std: float = 0.02) -> None:
        """The trunk's init (normal(0, std) matrices, unit norms), so a fresh drafter starts at the trunk's scale."""
        init_weights(self, std)

    def forward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        positions: Tensor | None,
        embed: Embed,
        lm_head: nn.Linear,
        cache: AttentionCache | None = None,
        layer: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Depth `layer` (i): `hidden` [B, T, H] at positions t, `input_ids` [B, T] holding token t+i+1 -> (state, logits).

        `hidden` is the trunk's final-normed state for depth 0 (then `input_ids[:, t]` is token t+1) and the previous
        depth's returned state after that; `positions` [B, T] are the positions t of `hidden` (default 0..T-1);
        `embed` maps ids to the target's embeddings and `lm_head` is the target's head. Returns the depth's normed
        state [B, T, H] (what the next depth reads) and logits [B, T, V] for token t+i+2.
        """
        out = self.state(hidden, input_ids, positions, embed, cache, layer)
        return out, self.logits(out, lm_head)

    def state(self, hidden: Tensor, input_ids: Tensor, positions: Tensor | None, embed: Embed,
              cache: AttentionCache | None = None, layer: int = 0) -> Tensor:
        """The state half of `forward` (what the next depth reads), without the logits: drafting needs logits only
        at each sequence's last row, not at every catch-up row."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"MTP layer {layer} out of range: this drafter has {len(self.layers)} depth(s)")
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rotary(positions, self.target_config.head_dim, self.target_config.rope_theta, hidden.dtype, cache)
        return self.layers[layer](hidden, embed(input_ids).detach(), cos, sin, cache)

    def store(self, hidden: Tensor, input_ids: Tensor, positions: Tensor, embed: Embed, cache: AttentionCache,
              layer: int = 0) -> None:
        """What `state` writes into `cache` (depth `layer`'s keys and values at `positions`), without the state."""
        cos, sin = rotary(positions, self.target_config.head_dim, self.target_config.rope_theta, hidden.dtype, cache)
        self.layers[layer].store(hidden, embed(input_ids).detach(), cos, sin, cache)

    @staticmethod
    def logits(state: Tensor, lm_head: nn.Linear) -> Tensor:
        """Logits of a depth's `state` through the target's head (read detached: only the RL loss trains it)."""
        if packable(state, (lm_head,)):  # the engine's drafting (no autograd): the packed head, as the target's
            return linears(state, lm_head)[0]
        bias = None if lm_head.bias is None else lm_head.bias.detach()
        return F.linear(state, lm_head.weight.detach(), bias)

    def draft(self, hidden: Tensor, input_ids: Tensor, last: Tensor, rounds: int, lm_head: nn.Linear,
              embeddings: Tensor, cache: BatchView) -> Tensor | None:
        """Greedy drafts [B, rounds] of the last depth in one kernel call (`kernels.mtp_draft`): its catch-up over
        `hidden` [B, T, H] and `input_ids` [B, T] through `cache` (as `state`), read on from each sequence's row
        `last` [B]; draft r is then the argmax of the target's `lm_head` on the state, and the depth reads that state
        and draft r's row of the target's `embeddings` at the next position (as `state` again). The same kernels in
        the same order as those calls and an argmax a round, so the same drafts. None where they would not all take
        the kernels (the depth's fused path, the head's kernel linear): the caller then runs the rounds itself."""
        depth, head, rows = self.layers[-1], (lm_head,), hidden[:, 0]
        plan = depth.plan()
        if not (plan.takes(rows) and packable(rows, head) and kernel_takes(rows, head)
                and embeddings.dtype == hidden.dtype):
            return None
        pack, cfg = packed(head), self.target_config
        rope = rope_table(cfg.head_dim, cfg.rope_theta, hidden.dtype, hidden.device, cache.cache.max_len)
        return kernels.mtp_draft(hidden, input_ids, cache.positions, last, rounds, (pack.plain, pack.bias), embeddings,
                                 rope, *plan.head_args, plan.weights, *cache.layer_cache(plan.cache_layer),
                                 cache.slots, *plan.heads)

    def forward_all(
        self, hidden: Tensor, input_ids: Tensor, positions: Tensor | None, embed: Embed, lm_head: nn.Linear
    ) -> list[Tensor]:
        """Every depth over a full teacher-forced sequence (Megatron-Core's training layout), no cache.

        `hidden` [B, T, H] is the trunk's state for `input_ids` [B, T]. Entry i of the result is the logits
        [B, T-i-1, V] of depth i, row t predicting `input_ids[:, t+i+2]` (the last row of each has no label).
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        logits = []
        for i in range(len(self.layers)):
            n = T - i - 1
            if n < 1:
                break
            hidden, out = self(hidden[:, :n], input_ids[:, i + 1 :], positions[:, :n], embed, lm_head, layer=i)
            logits.append(out)
        return logits
