"""Drafter training losses: soft cross-entropy against the target's detached distribution.

The same functions serve offline initialisation (`megatron-spec train-drafter`) and online training during RL:
they take the target's hidden states and logits from a forward that already happened, detach them, and return a
loss whose gradient reaches only the drafter. Matching the target's whole distribution (not its sampled token)
is what the drafter is judged on at verification time, where acceptance is sum_x min(p(x), q(x)).

An EAGLE-3 head with a draft vocabulary (`d2t`) learns the target's distribution restricted to the draft ids and
renormalised, p~ = p|D / p(D). The mass outside D can never be drafted, whatever the head does (those tokens still
reach the output through the verifier's residual and bonus samples from the full p, so output stays lossless);
q = p~ is then a best head (it reaches the acceptance bound sum_x min(p, q) = p(D)). Renormalising makes the loss a
true cross-entropy H(p~, q) = H(p~) + KL(p~ || q) at every position, with the same weight per position; the
unnormalised restriction would have the same minimiser but weigh each position by p(D), i.e. learn least exactly
where the draft vocabulary covers the target worst.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..models.eagle3 import Eagle3Head, captured_layers
from ..models.mtp import MTP


def soft_cross_entropy(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions of -sum_x p_teacher(x) log q_student(x); the teacher is detached."""
    teacher = teacher_logits.detach().float().softmax(-1)
    per_pos = -(teacher * F.log_softmax(student_logits.float(), -1)).sum(-1)
    mask = mask.to(per_pos.dtype)
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


def mtp_loss(target: CausalLM, mtp: MTP, input_ids: Tensor, out: TrunkOutput, logits: Tensor, mask: Tensor) -> Tensor:
    """Depth i at position t predicts token t+i+2, whose target distribution is the trunk's logits at t+i+1."""
    depth_logits = mtp.forward_all(out.hidden.detach(), input_ids, None, target.embed, target.lm_head)
    losses = []
    for i, lg in enumerate(depth_logits):
        n = lg.shape[1] - 1  # the last row's label lies past the end
        if n > 0:
            losses.append(soft_cross_entropy(lg[:, :n], logits[:, i + 1 : i + 1 + n], mask[:, i + 2 : i + 2 + n]))
    return torch.stack(losses).mean()


def teacher_logits(target: CausalLM, drafter, hidden: Tensor) -> Tensor:
    """The target's logits [.., V] from its final hidden states, or only the draft-vocabulary columns [.., N] for
    an EAGLE-3 head with a `d2t` map (N/V of the head matmul: what makes training on cached features cheap)."""
    d2t = drafter.d2t if isinstance(drafter, Eagle3Head) else None
    weight = target.lm_head.weight if d2t is None else target.lm_head.weight[d2t]
    return F.linear(hidden, weight.detach())


def restrict_to_draft_vocab(head: Eagle3Head, logits: Tensor) -> Tensor:
    """Target logits over the head's output ids: the d2t columns of full-vocabulary logits (a softmax over them is
    the renormalised restriction); logits already restricted (`teacher_logits`) or a full-vocabulary head pass as is."""
    if head.d2t is None or logits.shape[-1] == head.lm_head.out_features:
        return logits  # draft_vocab_size < vocab_size is enforced, so the width tells which one we have
    return logits.index_select(-1, head.d2t)


def eagle3_loss(target: CausalLM, head: Eagle3Head, input_ids: Tensor, out: TrunkOutput, logits: Tensor,
                mask: Tensor, unroll: int = 2) -> Tensor:
    """Step s (0-based) at position t reads the fused target state (s=0) or its own previous state, and the token
    t+s+1, and predicts token t+s+2 against the trunk's logits at t+s+1. Unrolling trains the head on its own
    states, as it is used when drafting more than one token (EAGLE-3's training-time test). With a draft
    vocabulary the teacher is the target's distribution restricted to it and renormalised (module docstring)."""
    logits = restrict_to_draft_vocab(head, logits)
    hidden = head.fuse(out.layers)
    T = input_ids.shape[1]
    losses = []
    for s in range(unroll):
        n = T - s - 1
        if n < 2:
            break
        hidden, lg = head(hidden[:, :n], input_ids[:, s + 1 : s + 1 + n], None, target.embed)
        m = n - 1  # row t predicts token t+s+2; the last row's label lies past the end
        losses.append(soft_cross_entropy(lg[:, :m], logits[:, s + 1 : s + 1 + m], mask[:, s + 2 : s + 2 + m]))
    return torch.stack(losses).mean()


def draft_model_loss(draft: CausalLM, input_ids: Tensor, logits: Tensor, mask: Tensor) -> Tensor:
    """Distillation: the draft model's next-token distribution against the target's at every position."""
    return soft_cross_entropy(draft(input_ids)[:, :-1], logits[:, :-1], mask[:, 1:])


def drafter_loss(method: str, target: CausalLM, drafter, input_ids: Tensor, mask: Tensor,
                 out: TrunkOutput | None = None, logits: Tensor | None = None) -> Tensor:
    """Loss of `drafter` on `input_ids` [B, T]; `mask` [B, T] marks the tokens worth predicting (generated ones).

    `out`/`logits` are the target's trunk output and logits for `input_ids` when the caller already has them (the
    RL step does); a missing `out` runs the target here without gradient, and missing `logits` are computed from
    `out.hidden` (only the draft-vocabulary columns for an EAGLE-3 head with one: cached features stay cheap).
    """
    if out is None:
        with torch.no_grad():
            out = target.trunk(input_ids, capture=captured_layers(drafter))
    if logits is None:
        with torch.no_grad():
            logits = teacher_logits(target, drafter, out.hidden)
    logits = logits.detach()
    if method == "mtp":
        return mtp_loss(target, drafter, input_ids, out, logits, mask)
    if method == "eagle3":
        return eagle3_loss(target, drafter, input_ids, out, logits, mask)
    if method == "draft_model":
        return draft_model_loss(drafter, input_ids, logits, mask)
    raise ValueError(f"method {method!r} has no trainable drafter (mtp, eagle3 and draft_model do)")
