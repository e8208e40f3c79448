"""Our MTP drafter as a vLLM model class (`MegatronSpecMTP`), registered by the plugin.

vLLM has no MTP class for Qwen3; this one computes Megatron-Core's MTP layer exactly as `drafters/mtp/model.py` defines it:

    x = eh_proj(cat[enorm(embed(token)), hnorm(h_prev)])
    h = final_layernorm(transformer_layer(x))       # a decoder layer of the target's kind (vLLM's own Qwen3 layer)
    logits = lm_head(h)                             # the target's head: vLLM's proposer shares it for MTP models

vLLM's MTP proposer hands step 0 the target's last hidden state (after the target's final norm, as Megatron-Core
does) with the next token's id at the same position, and every later step the state this model returned, so the
chaining is ours. Depth: vLLM's generic proposer never says which draft step it runs; the plugin resets a counter
at each `propose` and this class counts its forward calls, using depth min(step, num_layers - 1) (our proposer
re-applies the last depth the same way). Embedding and head are not in the drafter's checkpoint: vLLM replaces
this model's `embed_tokens` and `lm_head` by the target's after loading.

Weight names are our drafter's own (`mtp.layers.{i}.enorm.weight`, `...transformer_layer.self_attn.q_proj.weight`),
so the checkpoint our `save_drafter` writes and the `drafter.` refit stream load unchanged; q/k/v and gate/up are
stacked into vLLM's fused projections on load. Qwen3-MoE targets get vLLM's `Qwen3MoeDecoderLayer`: the router is
`...mlp.gate.weight` as in our naming, and the per-expert tensors (`...mlp.experts.{e}.{gate,up,down}_proj.weight`)
go to the fused-experts module's own `load_weights`, which stacks them into its `w13` / `w2` tensors (the loader
vLLM's Qwen3-MoE model uses too), so the drafter's checkpoint and refit stream stay in our naming.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
           (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


EXPERTS = ".mlp.experts."


def is_sparse(config, index: int) -> bool:
    """Whether decoder layer `index` is an MoE layer under the Qwen3-MoE rules (`decoder_sparse_step`,
    `mlp_only_layers`), as both our model and vLLM's decide it."""
    return (getattr(config, "num_experts", 0) > 0 and index not in (getattr(config, "mlp_only_layers", None) or ())
            and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def decoder_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    config = vllm_config.model_config.hf_config
    family = getattr(config, "target_model_type", config.model_type)
    if family == "qwen3_moe":
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeDecoderLayer

        # Our MTP layer is a copy of the trunk's last layer (drafters/mtp/model.py); vLLM decides dense vs MoE from the
        # index in `prefix` (past the trunk's), so the two must agree or the weights would not fit.
        index = int(prefix.rsplit(".", 1)[-1])
        if is_sparse(config, index) != is_sparse(config, config.num_hidden_layers - 1):
            kind = "MoE" if is_sparse(config, index) else "dense"
            raise NotImplementedError(
                f"MegatronSpecMTP: with decoder_sparse_step={config.decoder_sparse_step} and mlp_only_layers="
                f"{config.mlp_only_layers} vLLM would build MTP layer {index} {kind}, unlike the trunk's last layer "
                "our MTP layer copies")
        return Qwen3MoeDecoderLayer(vllm_config, prefix=prefix)
    if family == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

        return Qwen3DecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)
    if family == "llama":
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        return LlamaDecoderLayer(vllm_config, prefix=prefix)
    raise NotImplementedError(f"MegatronSpecMTP: no MTP layer for target model_type {family!r}")


class MTPLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.transformer_layer = decoder_layer(vllm_config, prefix)
        self.final_layernorm = RMSNorm(H, eps=eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        out, residual = self.transformer_layer(positions, x, None)
        return self.final_layernorm(out + residual)


class MegatronSpecMTP(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        n = int(getattr(config, "num_nextn_predict_layers", 1))
        first = config.num_hidden_layers
        # `mtp.layers` as in our drafter's state dict; each attention is named after a layer index past the target's
        # so its KV cache is the drafter's own (vLLM tells draft layers apart by name).
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList(MTPLayer(vllm_config, f"mtp.layers.{first + i}") for i in range(n))
        # Placeholders: vLLM's proposer swaps in the target's embedding and head after loading (MTP shares both).
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.step = 0

    def reset_draft_step(self) -> None:
        self.step = 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None, spec_step_idx: int = 0):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        depth = min(max(self.step, spec_step_idx), len(self.mtp.layers) - 1)
        self.step += 1
        return self.mtp.layers[depth](inputs_embeds, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded = set()
        for name, w in weights:
            if not name.startswith("mtp."):
                continue  # a checkpoint may carry the shared embedding / head; the target's are used
            if EXPERTS in name:
                # `...mlp.experts.{e}.gate_proj.weight`: the fused-experts module maps expert e's tensor into its
                # stacked parameters itself, given the name relative to it; it yields the parameters it filled.
                owner, rest = name.split(EXPERTS, 1)
                experts = owner + EXPERTS.rstrip(".")
                filled = list(modules[experts].load_weights([(rest, w)]))
                if not filled:
                    raise KeyError(f"MegatronSpecMTP: checkpoint tensor {name!r} matched no expert parameter")
                loaded.update(f"{experts}.{p}" for p in filled)
                continue
            for ours, fused, shard in STACKED:
                if ours in name:
                    target = name.replace(ours, fused)
                    param = params[target]
                    param.weight_loader(param, w, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"MegatronSpecMTP: checkpoint tensor {name!r} has no parameter here")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
                loaded.add(name)
        # The embedding and head are the target's (shared after loading), never the drafter's to load.
        return loaded | {"model.embed_tokens.weight", "lm_head.weight"}
