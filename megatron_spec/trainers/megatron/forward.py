"""Forward passes over a `GPTModel`'s parts (one pipeline stage holding the whole model, PP=1): the policy's
logits, and the MTP layers' logits with the trunk detached, plus the MTP loss.

Training only the drafter: the trunk runs under `no_grad`, the MTP layers read detached hidden states and
detached token embeddings, and the shared output head is applied with a detached weight, so the MTP loss
reaches the MTP layers and nothing else (the known failure mode is an auxiliary MTP loss leaking into the trunk).
Megatron-Core's MTP layer k (0-based) at position i reads the trunk's final hidden state at i and the embedding
of token i+k+1, and predicts token i+k+2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_spec.models.masks import causal_mask

from . import require_megatron

require_megatron()


def _positions(input_ids: Tensor) -> Tensor:
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).expand(B, T)


def attention_mask(input_ids: Tensor) -> Tensor | None:
    """The causal mask to hand Megatron-Core for `input_ids` [B, T]. On CUDA Megatron makes it itself (and TE's fused
    attention wants none); its default is made on "cuda", so on CPU we pass one. Megatron reads a boolean mask as
    True = masked out: the inverse of our convention (models/masks.py)."""
    return None if input_ids.is_cuda else ~causal_mask(input_ids.shape[1], input_ids.device)


def trunk_hidden(model, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(final hidden states [T, B, H] after the last norm, rotary embedding, attention mask)."""
    if not (model.pre_process and model.post_process):
        raise ValueError("trunk_hidden needs the whole model on one stage (PP=1)")
    T = input_ids.shape[1]
    mask = attention_mask(input_ids)
    rotary = model.rotary_pos_emb(T)
    x = model.embedding(input_ids=input_ids, position_ids=_positions(input_ids))
    return model.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary), rotary, mask


def head(model, hidden: Tensor, detach_weight: bool = False) -> Tensor:
    """Output head on [T, B, H] -> logits [B, T, vocab] (gathered over TP, vocabulary padding trimmed)."""
    w = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else model.output_layer.weight
    if detach_weight:
        w = w.detach()
    logits, _ = model.output_layer(hidden, weight=w, runtime_gather_output=True)
    return logits.transpose(0, 1)[..., : model.hf_config.vocab_size]


def trunk_logits(model, input_ids: Tensor) -> Tensor:
    """The policy's logits [B, T, vocab] for `input_ids` [B, T]."""
    return head(model, trunk_hidden(model, input_ids)[0])


def detached_mtp_logits(model, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(policy logits [B, T, V] without grad, [MTP depth k logits [B, T, V]]) with only the MTP layers in the graph."""
    if not getattr(model.config, "mtp_num_layers", None):
        raise ValueError("the model has no MTP layers (build it with mtp_num_layers >= 1)")
    with torch.no_grad():
        hidden, rotary, mask = trunk_hidden(model, input_ids)
        policy = head(model, hidden)

    def embed(input_ids, position_ids, **_):
        with torch.no_grad():
            return model.embedding(input_ids=input_ids, position_ids=position_ids)

    stacked = model.mtp(
        input_ids=input_ids, position_ids=_positions(input_ids), hidden_states=hidden.detach(),
        attention_mask=mask, rotary_pos_emb=rotary, embedding=embed,
    )
    depths = stacked.chunk(1 + model.config.mtp_num_layers, dim=0)[1:]
    return policy, [head(model, h, detach_weight=True) for h in depths]


def mtp_loss(policy_logits: Tensor, mtp_logits: list[Tensor], input_ids: Tensor, soft: bool = False) -> Tensor:
    """Mean over depths of the MTP cross-entropy.

    Hard: against the next-next token (`input_ids[i + k + 2]`). Soft: against the policy's own distribution for
    that token (`softmax(policy_logits[i + k + 1])`, detached), which keeps the drafter close to the moving policy.
    """
    T, losses = input_ids.shape[1], []
    for k, logits in enumerate(mtp_logits):
        n = T - k - 2
        if n <= 0:
            break
        pred = logits[:, :n].float()
        if soft:
            target = policy_logits[:, k + 1 : k + 1 + n].detach().float().softmax(-1)
            losses.append(-(target * pred.log_softmax(-1)).sum(-1).mean())
        else:
            losses.append(F.cross_entropy(pred.reshape(-1, pred.shape[-1]), input_ids[:, k + 2 :].reshape(-1)))
    if not losses:
        raise ValueError(f"sequence of {T} tokens is too short for MTP")
    return torch.stack(losses).mean()
