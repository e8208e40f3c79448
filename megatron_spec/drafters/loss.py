"""Drafter training losses: soft cross-entropy against the target's detached distribution.

Each method's folder builds its own (student, teacher) pairs (`mtp/loss.py`, `eagle3/loss.py`,
`draft_model/loss.py`, its registry entry's `online_loss`); what is shared lives here. The same functions serve
offline initialisation (`megatron-spec train-drafter`) and online training during RL:
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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from .eagle3.model import Eagle3Head, captured_layers
from ..models.layers import attend_unrolled
from ..speculative.sampling import processed_logprobs


def soft_cross_entropy(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions of -sum_x p_teacher(x) log q_student(x); the teacher is detached."""
    teacher = teacher_logits.detach().float().softmax(-1)
    per_pos = -(teacher * F.log_softmax(student_logits.float(), -1)).sum(-1)
    mask = mask.to(per_pos.dtype)
    return (per_pos * mask).sum() / mask.sum().clamp_min(1.0)


class DepthPair(NamedTuple):
    """One draft depth's predictions on a batch, aligned position by position with what they are judged against."""

    student: Tensor
    """The drafter's logits [B, n, N] (N: its output ids, the draft vocabulary of an EAGLE-3 head that has one)."""
    teacher: Tensor
    """The target's logits for the same tokens [B, n, V] (or already restricted to the draft vocabulary)."""
    mask: Tensor
    """[B, n] True where the predicted token is a generated one."""


TRAINED_DRAFTS = 3
"""Drafts trained per position as they are drafted: EAGLE-3's layer unrolled to 3 steps; an MTP head's depths, its
last depth chained up to 3 drafts in all. Drafts past them chain untrained. EAGLE-3 on the tiny model (offline,
400 steps; share of k=3 rounds whose first 1 / 2 / 3 drafts all stood, 64 sampled rollouts): 2 steps 0.82 / 0.72 /
0.44, acceptance length 2.98; 3 steps 0.80 / 0.72 / 0.66, 3.18 (k=5: 3.26 -> 3.99), for 1.6x the training time.
k=3 is the reference system's setting."""


class UnrolledAttention:
    """The `AttentionCache` of a drafter layer trained on its own chained steps: what each step's attention sees
    when it drafts (EAGLE-3's one layer; an MTP head's last depth, which drafting re-applies past the depths).

    Step 0 is the teacher-forced pass (over the target's features, or the previous depth's states). Step s > 0 at
    row t is the s-th draft chained after the one row t's step 0 made: its query sits at position t+s and attends
    to step 0's keys at positions 0..t and to its own keys of steps 1..s at row t (the drafts it chained through,
    positions t+1..t+s): nothing else. So step s attends to step 0's keys causally and to each later step's keys on
    the diagonal only. Attending causally to step s's own keys instead, as running the layer over its own states
    does, trains a context drafting never has: on the tiny model EAGLE-3's second draft then matched the target
    91 % of the time on the train batch, but in rollouts only 55-58 % of second drafts stood once the first had."""

    def __init__(self):
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        return attend_unrolled(q, self.keys, self.values)  # row t of every step is row t of step 0


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


def depth_pairs(online_loss, target: CausalLM, drafter, input_ids: Tensor, mask: Tensor,
                out: TrunkOutput | None = None, logits: Tensor | None = None,
                drafts: int = TRAINED_DRAFTS) -> list[DepthPair]:
    """The drafter's predictions on `input_ids` [B, T] per draft depth, beside the target's; `mask` [B, T] marks
    the tokens worth predicting (generated ones). `online_loss` is the method's pair builder, the registry entry's
    `online_loss` (`spec.registry.drafter_method(name).online_loss`).

    `out`/`logits` are the target's trunk output and logits for `input_ids` when the caller already has them (the
    RL step does); a missing `out` runs the target here without gradient, and missing `logits` are computed from
    `out.hidden` (only the draft-vocabulary columns for an EAGLE-3 head with one: cached features stay cheap).
    `drafts`: how many drafts per position an MTP / EAGLE-3 head is judged on (`TRAINED_DRAFTS`).
    """
    if online_loss is None:
        raise ValueError("this drafter method has no online loss (it has no weights to train)")
    if drafts < 1:
        raise ValueError(f"drafts must be >= 1, got {drafts}")
    if out is None:
        with torch.no_grad():
            out = target.trunk(input_ids, capture=captured_layers(drafter))
    if logits is None:
        with torch.no_grad():
            logits = teacher_logits(target, drafter, out.hidden)
    return online_loss(target, drafter, input_ids, out, logits.detach(), mask, drafts)


def pairs_loss(drafter, pairs: list[DepthPair]) -> Tensor:
    """Soft cross-entropy against the target, averaged over depths (an EAGLE-3 head with a draft vocabulary learns
    the target restricted to it, renormalised)."""
    losses = []
    for p in pairs:
        teacher = restrict_to_draft_vocab(drafter, p.teacher) if isinstance(drafter, Eagle3Head) else p.teacher
        losses.append(soft_cross_entropy(p.student, teacher, p.mask))
    return torch.stack(losses).mean()


def drafter_loss(online_loss, target: CausalLM, drafter, input_ids: Tensor, mask: Tensor,
                 out: TrunkOutput | None = None, logits: Tensor | None = None) -> Tensor:
    """Loss of `drafter` on `input_ids` [B, T] (`depth_pairs` for the arguments)."""
    return pairs_loss(drafter, depth_pairs(online_loss, target, drafter, input_ids, mask, out, logits))


def agreement(drafter, pairs: list[DepthPair], sampling: dict) -> tuple[list[float], list[float]]:
    """Per depth: the summed probability, under the target's processed distribution (`sampling`: temperature,
    top-k, top-p, as the engine verifies), of the token the drafter would propose greedily, and the number of
    positions summed over. Their ratio is the chance that depth's draft is accepted at a position the batch
    visits: a greedy draft x is accepted with probability min(1, p(x) / 1) = p(x). Needs full-vocabulary teacher
    logits (an EAGLE-3 choice is mapped through its d2t, so the mass outside its draft vocabulary counts as lost)."""
    d2t = drafter.d2t if isinstance(drafter, Eagle3Head) else None
    sums, counts = [], []
    for p in pairs:
        choice = p.student.detach().argmax(-1)
        if d2t is not None:
            if p.teacher.shape[-1] == drafter.lm_head.out_features:
                raise ValueError("agreement needs the target's full-vocabulary logits, not the draft-vocabulary ones")
            choice = d2t[choice]
        prob = processed_logprobs(p.teacher.detach(), **sampling).exp().gather(-1, choice[..., None]).squeeze(-1)
        sums.append(float(prob[p.mask].sum()))
        counts.append(float(p.mask.sum()))
    return sums, counts
