"""EAGLE-3 style draft head (Li et al. 2025), weights and forward only.

The head fuses three of the target's hidden states (a low, a middle and a high layer) into one H-wide vector, then
runs one decoder layer whose attention reads that vector next to the embedding of the following token:

    g = fc(cat[h_low, h_mid, h_high])                                 # first draft step only
    x = cat[input_layernorm(embed(token)), hidden_norm(g)]            # 2H wide: q/k/v read both halves
    h = g + o_proj(attention(x));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

Later draft steps feed the head its own `h` in place of `g` (EAGLE-3's training-time test, used at test time too),
so `forward` takes "a hidden state" and `fuse` is only called on the target's captured states.

The draft vocabulary is the target's by default. With `draft_vocab_size` N > 0 (EAGLE-3's reduced vocabulary) the
head's `lm_head` has only N rows and the buffer `d2t` [N] maps draft id -> target id: a head drafts d2t[argmax], so
the one matrix that dominates a draft step on a large-vocabulary target (49152 x 576 on SmolLM2) shrinks by V/N.
Tokens outside the map can never be drafted, but the verifier still emits them (residual and bonus samples come
from the target's full distribution), so output stays lossless. The embedding belongs to the target: passed in,
never saved, read through `.detach()`, always indexed by *target* ids; the head's own `lm_head` starts as a copy
of the target's rows for the ids it covers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...models.config import ModelConfig
from ...models.decoder import CausalLM, init_weights
from ...models.layers import MLP, Attention, AttentionCache, RMSNorm, rotary
from ...models.packed import linears

Embed = Callable[[Tensor], Tensor]
"""Token ids [B, T] -> the target's embeddings [B, T, H] (`CausalLM.embed`)."""


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (low, mid, high) = (1, N//2 - 1, N - 4), made to fit models shallower than 8 layers.

    EAGLE-3 hooks the *inputs* of layers 2, N//2 and N-3, i.e. the outputs of layers 1, N//2-1 and N-4, which is
    what `CausalLM.trunk(capture=...)` records. For small N each index is clamped into [0, N-1] and the triple made
    non-decreasing (mid >= low, high >= mid), so a shallow model may fuse one layer more than once (N=4 gives
    (1, 1, 1)); `fc` still sees three H-wide inputs, so the weight shapes never depend on N.
    """
    top = num_layers - 1
    low = min(1, top)
    mid = min(max(num_layers // 2 - 1, low), top)
    high = min(max(num_layers - 4, mid), top)
    return low, mid, high


@dataclass
class Eagle3Config:
    target_num_layers: int
    """Decoder layers of the target; the default capture rule and the range check need it."""
    capture_layers: tuple[int, ...] = ()
    """Target layers (low, mid, high) whose outputs are fused, in that order; () picks `default_capture_layers`."""
    intermediate_size: int = 0
    """FFN width of the head's dense MLP; 0 means the target's `intermediate_size` (resolved by `Eagle3Head`)."""
    draft_vocab_size: int = 0
    """Rows of the head's `lm_head`: 0 = the target's full vocabulary (no `d2t` map); N > 0 (smaller than the
    target's vocabulary) drafts only the N target ids listed in the head's `d2t` buffer, saved with the head."""
    norm_before_residual: bool = False
    """The layer's residual is the normed hidden state (`hidden_norm(hidden)`) instead of the hidden state itself:
    how some public heads were trained (vLLM's and speculators' `norm_before_residual`)."""
    qk_norm: bool | None = None
    """Whether the layer's attention norms its queries and keys per head; None: as the target does. Public heads for
    Qwen3 targets often have a Llama-type layer without them."""

    def __post_init__(self) -> None:
        if self.target_num_layers < 1:
            raise ValueError(f"Eagle3Config.target_num_layers must be >= 1, got {self.target_num_layers}")
        self.capture_layers = tuple(int(i) for i in self.capture_layers) or default_capture_layers(self.target_num_layers)
        if len(self.capture_layers) != 3:
            raise ValueError(f"Eagle3Config.capture_layers needs three layers (low, mid, high), got {self.capture_layers}")
        bad = [i for i in self.capture_layers if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(
                f"Eagle3Config.capture_layers {self.capture_layers}: layer(s) {bad} outside the target's "
                f"0..{self.target_num_layers - 1}"
            )
        if self.intermediate_size < 0:
            raise ValueError(f"Eagle3Config.intermediate_size must be >= 0, got {self.intermediate_size}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"Eagle3Config.draft_vocab_size must be >= 0 (0 = the target's vocabulary), "
                             f"got {self.draft_vocab_size}")


def check_d2t(d2t: Tensor, draft_vocab_size: int, vocab_size: int, where: str = "d2t") -> None:
    """Raise unless `d2t` is a draft-to-target map the verifier can trust: 1-D integer ids, `draft_vocab_size` of
    them, each a target id (0 <= id < vocab_size), no id twice (a duplicate would split one target token's draft
    mass over two rows and leave the map non-invertible)."""
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{where} must be a 1-D integer tensor of target ids, got {d2t.dtype} of shape "
                         f"{tuple(d2t.shape)}")
    if d2t.numel() != draft_vocab_size:
        raise ValueError(f"{where} maps {d2t.numel()} draft ids, the head's draft_vocab_size is {draft_vocab_size}")
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size):
        bad = d2t[(d2t < 0) | (d2t >= vocab_size)]
        raise ValueError(f"{where} holds id(s) outside the target vocabulary 0..{vocab_size - 1}, "
                         f"e.g. {bad[:3].tolist()}")
    if d2t.unique().numel() != d2t.numel():
        values, counts = d2t.unique(return_counts=True)
        raise ValueError(f"{where} lists target id(s) more than once, e.g. {values[counts > 1][:3].tolist()}")


class WideInputAttention(Attention):
    """The trunk's attention, except q/k/v read a 2H-wide input ([embedding, hidden]); o_proj still writes H."""

    def __init__(self, cfg: ModelConfig, layer: int, in_features: int):
        super().__init__(cfg, layer)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)


class Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: pre-norm attention over [embedding, hidden], then a SwiGLU MLP, both residual."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        # One extra KV-cache layer right after the target's.
        self.self_attn = WideInputAttention(cfg, cfg.num_hidden_layers, 2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, intermediate_size)

    def forward(
        self, hidden: Tensor, token_embeds: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache | None
    ) -> Tensor:
        # The residual is the un-normed hidden state (or, with `norm_before_residual`, the normed one): the embedding
        # only informs attention, as in EAGLE-3.
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn(self.attention_input(hidden, token_embeds), cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention_input(self, hidden: Tensor, token_embeds: Tensor) -> Tensor:
        return torch.cat((self.input_layernorm(token_embeds), self.hidden_norm(hidden)), dim=-1)

    def store(self, hidden: Tensor, token_embeds: Tensor, cos: Tensor, sin: Tensor, cache: AttentionCache) -> None:
        """Only the keys and values `forward` writes into `cache` (`Attention.store`)."""
        self.self_attn.store(self.attention_input(hidden, token_embeds), cos, sin, cache)


class Eagle3Head(nn.Module):
    """Fusion `fc`, one `midlayer`, `norm` and an own `lm_head` over the target's or a draft vocabulary."""

    d2t: Tensor | None
    """[draft_vocab_size] int64, draft id -> target id; None with the full vocabulary (not in the state dict then,
    so full-vocabulary checkpoints keep their tensor names)."""

    def __init__(self, target_config: ModelConfig, eagle_config: Eagle3Config | None = None,
                 d2t: Tensor | None = None):
        super().__init__()
        eagle_config = eagle_config or Eagle3Config(target_num_layers=target_config.num_hidden_layers)
        if eagle_config.target_num_layers != target_config.num_hidden_layers:
            raise ValueError(
                f"Eagle3Config is for a {eagle_config.target_num_layers}-layer target, this target has "
                f"{target_config.num_hidden_layers}"
            )
        inner = eagle_config.intermediate_size or target_config.intermediate_size
        if inner < 1:
            raise ValueError("Eagle3Config.intermediate_size must be set: the target has no dense intermediate_size")
        V, N = target_config.vocab_size, eagle_config.draft_vocab_size
        if N >= V:
            raise ValueError(f"Eagle3Config.draft_vocab_size {N} must be smaller than the target's vocabulary ({V}); "
                             "0 selects the full vocabulary")
        # Stored resolved, so a saved config rebuilds the same shapes whatever the target's defaults become.
        self.eagle_config = Eagle3Config(eagle_config.target_num_layers, eagle_config.capture_layers, inner, N,
                                         eagle_config.norm_before_residual, eagle_config.qk_norm)
        self.target_config = target_config  # not `config`: see the note in mtp.MTP
        H = target_config.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        layer_config = target_config if eagle_config.qk_norm in (None, target_config.qk_norm) else (
            dataclasses.replace(target_config, qk_norm=eagle_config.qk_norm))
        self.midlayer = Eagle3Layer(layer_config, inner, eagle_config.norm_before_residual)
        self.norm = RMSNorm(H, target_config.rms_norm_eps)
        self.lm_head = nn.Linear(H, N or V, bias=False)
        if d2t is not None:
            if not N:
                raise ValueError("a d2t map needs Eagle3Config.draft_vocab_size > 0")
            check_d2t(d2t, N, V)
            d2t = d2t.to(torch.long).clone()
        elif N:
            d2t = torch.arange(N)  # a placeholder of the right shape: from_target and load_drafter set the real map
        self.register_buffer("d2t", d2t)
        self.reset_parameters()

    @classmethod
    def from_target(cls, target: CausalLM, eagle_config: Eagle3Config | None = None,
                    d2t: Tensor | None = None) -> "Eagle3Head":
        """A fresh head for `target` on its device and dtype, its `lm_head` starting as a copy of the target's rows
        (all of them, or those of the target ids in `d2t`, the draft vocabulary, whose size sets
        `draft_vocab_size` when the config leaves it 0)."""
        eagle_config = eagle_config or Eagle3Config(target_num_layers=target.config.num_hidden_layers)
        if d2t is not None and not eagle_config.draft_vocab_size:
            eagle_config = dataclasses.replace(eagle_config, draft_vocab_size=d2t.numel())
        if eagle_config.draft_vocab_size and d2t is None:
            raise ValueError(f"a head with draft_vocab_size {eagle_config.draft_vocab_size} needs its d2t map "
                             "(the target ids of its draft vocabulary)")
        head = cls(target.config, eagle_config, d2t).to(device=target.device, dtype=target.dtype)
        with torch.no_grad():
            rows = target.lm_head.weight if head.d2t is None else target.lm_head.weight[head.d2t]
            head.lm_head.weight.copy_(rows)
        return head

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Pass to `CausalLM.trunk(capture=...)` to get what `fuse` needs."""
        return self.eagle_config.capture_layers

    @property
    def num_cache_layers(self) -> int:
        """Extra KV-cache layers (after the target's) this drafter writes."""
        return 1

    def reset_parameters(self, std: float = 0.02) -> None:
        """The trunk's init (normal(0, std) matrices, unit norms)."""
        init_weights(self, std)

    def fuse(self, captured: dict[int, Tensor]) -> Tensor:
        """[B, T, H] from the target's captured layer outputs (`TrunkOutput.layers`), low, mid, high in order."""
        return linears(self.stack(captured), self.fc)[0]

    def stack(self, captured: dict[int, Tensor]) -> Tensor:
        """The unfused input of `fuse`, [B, T, 3H] (the engine stores the captured layers side by side like this and
        fuses only the rows it drafts from).

        Detached: the target's states are inputs to the drafter, never trained through.
        """
        missing = [i for i in self.capture_layers if i not in captured]
        if missing:
            raise KeyError(f"EAGLE-3 fuse needs target layer(s) {missing}; capture {self.capture_layers} in trunk()")
        return torch.cat([captured[i].detach() for i in self.capture_layers], dim=-1)

    def forward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        positions: Tensor | None,
        embed: Embed,
        cache: AttentionCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`hidden` [B, T, H] at positions t (fused target state, or this head's previous output) and `input_ids`
        [B, T] holding token t+1 -> (state [B, T, H] before `norm`, feed it to the next step; logits [B, T, V] for
        token t+2; over the draft vocabulary when the head has one, map with `d2t`). `positions` default to 0..T-1;
        `embed` maps (target) ids to the target's embeddings."""
        out = self.state(hidden, input_ids, positions, embed, cache)
        return out, self.logits(out)

    def state(self, hidden: Tensor, input_ids: Tensor, positions: Tensor | None, embed: Embed,
              cache: AttentionCache | None = None, layer: int = 0) -> Tensor:
        """The state half of `forward`, without the logits (drafting needs them only at each sequence's last row).
        `layer`: the depth, always 0 (one depth; the argument lets drafting call every head alike)."""
        one_depth(layer)
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rotary(positions, self.target_config.head_dim, self.target_config.rope_theta, hidden.dtype, cache)
        return self.midlayer(hidden, embed(input_ids).detach(), cos, sin, cache)

    def store(self, hidden: Tensor, input_ids: Tensor, positions: Tensor, embed: Embed, cache: AttentionCache,
              layer: int = 0) -> None:
        """What `state` writes into `cache` (its keys and values at `positions`), without the state."""
        one_depth(layer)
        cos, sin = rotary(positions, self.target_config.head_dim, self.target_config.rope_theta, hidden.dtype, cache)
        self.midlayer.store(hidden, embed(input_ids).detach(), cos, sin, cache)

    def logits(self, state: Tensor) -> Tensor:
        """Logits of a `state` (over the draft vocabulary when the head has one)."""
        return linears(self.norm(state), self.lm_head)[0]


def one_depth(layer: int) -> None:
    if layer != 0:
        raise ValueError(f"an EAGLE-3 head has one depth (layer 0), got layer {layer}")


def captured_layers(drafter) -> tuple[int, ...]:
    """The target layers a drafter reads besides the final hidden state, distinct and in order (pass to
    `CausalLM.trunk(capture=...)`): an EAGLE-3 head's fused layers, none for any other drafter (or None)."""
    return tuple(dict.fromkeys(drafter.capture_layers)) if isinstance(drafter, Eagle3Head) else ()
