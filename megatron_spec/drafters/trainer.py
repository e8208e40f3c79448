"""Online drafter training: one `DrafterTrainer` holds a drafter's optimizer, the weights' average
(`drafter_train.ema`), the replayed steps (`drafter_train.replay`), their minibatches and the step's deadline. Every
trainer backend feeds it the same thing, the detached states of the policy's forward per micro-batch
(`DrafterInputs`), and reads back the same metrics: the embedded trainer from its own forward, the Megatron trainer's
EAGLE-3 head from the states it gathers on one rank; `train-drafter` takes its optimizer steps offline.

The drafter reads the target's states and logits detached and has its own optimizer and its own backward, so its
loss cannot send gradient into the policy.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch
from torch import Tensor

from ..models.decoder import TrunkOutput
from ..microbatch import spread_rows
from .loss import agreement, depth_pairs, pairs_loss
from .registry import drafter_method

# `DrafterInputs` in the annotations is `trainers.embedded.DrafterInputs`, named but not imported: that module
# imports this one (annotations are not evaluated).

MAX_GRAD_NORM = 1.0
"""The drafter's gradient clip, online and offline (and the Megatron trainer's MTP layers')."""


class Deadline:
    """When the drafter's training on a step stops: `seconds` after it starts (None: it runs whole). The whole-step
    gate gives it what the step's generation saved (`WholeStepGate.drafter_budget`); past that the step cannot pay,
    and what is left of the training would only slow it down further."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.perf_counter() + seconds
        self.stopped = False  # whether some of the training was left out for it

    def stops(self) -> bool:
        """Whether the next piece of the training is left out (the deadline has passed)."""
        self.stopped = self.stopped or (self.end is not None and time.perf_counter() >= self.end)
        return self.stopped


def join(parts: list[DrafterInputs]) -> DrafterInputs:
    """The rows of `parts` as one batch, each right-padded with zeros (and a False mask) to the longest. Every
    drafter attends causally and its loss reads only masked-in positions, so a row's predictions and loss are its
    own whatever it is batched with, up to the order a matmul sums in."""
    T = max(p.input_ids.shape[1] for p in parts)

    def cat(tensors: list[Tensor]) -> Tensor:
        out = tensors[0].new_zeros((sum(t.shape[0] for t in tensors), T, *tensors[0].shape[2:]))
        row = 0
        for t in tensors:
            out[row : row + t.shape[0], : t.shape[1]] = t
            row += t.shape[0]
        return out

    layers = {i: cat([p.out.layers[i] for p in parts]) for i in parts[0].out.layers}
    return parts[0]._replace(input_ids=cat([p.input_ids for p in parts]), mask=cat([p.mask for p in parts]),
                             out=TrunkOutput(cat([p.out.hidden for p in parts]), layers),
                             logits=cat([p.logits for p in parts]))


def pack(parts: list[DrafterInputs], budget: int) -> list[DrafterInputs]:
    """`parts` joined, in order, into as few batches as keep rows x longest row within `budget` tokens (a part
    alone may exceed it; 0: no limit). Dealing a step's micro-batches into minibatches leaves a few rows of each
    micro-batch per minibatch, and each drafter pass pays a fixed overhead, so they are joined back up to the size
    the policy's own micro-batches have: 1.30-1.53x faster updates on the main job's model
    (`research/drafter_update.py`)."""
    out: list[list[DrafterInputs]] = []
    rows = longest = 0
    for p in parts:
        b, t = p.input_ids.shape
        if out and (not budget or (rows + b) * max(longest, t) <= budget):
            out[-1].append(p)
            rows, longest = rows + b, max(longest, t)
        else:
            out.append([p])
            rows, longest = b, t
    return [join(group) if len(group) > 1 else group[0] for group in out]


def minibatches(forwards: list[DrafterInputs], tokens: float, count: int,
                budget: int) -> list[tuple[list[DrafterInputs], float]]:
    """One step's micro-batches (with `tokens` generated tokens) dealt into `count` minibatches, row i of each to
    minibatch i mod count, each with its generated tokens and its rows packed into batches of up to `budget` tokens
    (`pack`); a minibatch with no rows is left out. With count 1: the step's micro-batches as they are."""
    if count == 1:
        return [(forwards, tokens)]
    out = []
    for j in range(count):
        part = [f.rows(slice(j, None, count)) for f in forwards if f.input_ids.shape[0] > j]
        if part:
            out.append((pack(part, budget), float(sum(f.mask.sum() for f in part))))
    return out


class DrafterTrainer:
    """The online training of `drafter` (registry method `method`) under the `drafter_train` section `cfg`: AdamW
    when `cfg.online` and `learns` (a rank that only gathers for another has none), the weights' average when
    `cfg.ema`, the last `cfg.replay` steps' states, minibatches packed up to `pack_tokens` tokens (the policy's
    `grpo.micro_batch_tokens`), agreement measured under `sampling` (the engine's processing)."""

    def __init__(self, drafter, method: str, cfg, sampling: dict, pack_tokens: int, learns: bool = True):
        self.drafter, self.method, self.cfg = drafter, method, cfg
        self.sampling, self.pack_tokens = sampling, pack_tokens
        self.opt = self.ema = None
        if cfg.online and learns:
            self.opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0)
            if cfg.ema:  # the weights that draft (refit into the generator): the trained ones' average
                self.ema = copy.deepcopy(drafter).requires_grad_(False).eval()
        # The last `replay` steps' detached states, oldest first: (micro-batches, generated tokens).
        self.replay: deque[tuple[list[DrafterInputs], float]] = deque(maxlen=cfg.replay)
        # It reads a step's forwards to train (online) and/or to measure its agreement.
        self.reads = cfg.online or cfg.agreement

    @property
    def online(self) -> bool:
        """Whether it takes optimizer steps (it has the optimizer)."""
        return self.opt is not None

    @property
    def drafting(self):
        """The weights that draft, refit into the generator: the average where there is one, else the trained."""
        return self.drafter if self.ema is None else self.ema

    def rows(self, mask: Tensor) -> list[int]:
        """The rows of a step's batch (generated-token `mask` [B, T]) a trainer that bounds the drafter's memory keeps
        for it: within `drafter_train.max_tokens` (`spread_rows`; every row at 0)."""
        return spread_rows(mask, self.cfg.max_tokens)

    def step(self, target, forwards: list[DrafterInputs], tokens: float, deadline: Deadline | None = None) -> dict:
        """The drafter's update on a step's `forwards` (its micro-batches' detached states, `tokens` generated tokens)
        after the policy's: `target` gives what the online loss reads of the policy as it is now (the MTP /
        EAGLE-3 heads its embedding and output head). Also the drafter's agreement with the policy on this batch
        (`loss.agreement`); a frozen drafter only measures, without gradient.

        Online, `drafter_train.updates` passes over the replayed steps (this one and up to `replay - 1` before it,
        oldest first, so each pass ends on this batch), one optimizer step per minibatch (`minibatches` per step).
        Re-reading detached states costs no trunk forward; the earlier steps' states are an earlier policy's, which
        the last optimizer steps of each pass, on this step's batch, correct towards the policy that drafts next.

        Loss and agreement are those of the drafter that drafted this batch, before it learns from it: measured in
        the first optimizer step when that one is over this batch and the trained weights draft, else by a pass
        without gradient first (of the weights' average where that drafts, `drafter_train.ema`). Once the `deadline`
        passes no further optimizer step starts (the measuring one always runs).

        A step's drafter loss is a mean over its generated tokens (per depth, or per unrolled step); weighted by its
        micro-batches' shares of the generated tokens, the shares add up to the one-big-batch loss exactly when
        every depth's mean counts all generated tokens: draft d's prediction has no label before position d + 1, so
        prompts must be at least as long as the drafts trained per position (`drafter_train.drafts`) + 1. Every task
        prompt is (BOS + a problem); a shorter one only shifts the weights of its first few tokens' predictions.
        """
        batches = [(forwards, tokens)]
        if self.online:
            self.replay.append((forwards, tokens))
            one_pass = [mb for f, t in self.replay for mb in minibatches(f, t, self.cfg.minibatches, self.pack_tokens)]
            batches = one_pass * self.cfg.updates
        measured = None
        if batches[0][0] is not forwards or self.drafting is not self.drafter:
            measured = self.run_pass(target, forwards, tokens, learn=False, measure=True, drafter=self.drafting)
        passes = []
        for i, (f, t) in enumerate(batches):
            if (passes or measured is not None) and deadline is not None and deadline.stops():
                break
            passes.append(self.run_pass(target, f, t, learn=self.online, measure=measured is None and i == 0))
        loss, agreement_by_depth = measured or passes[0]
        metrics = {"drafter_loss": loss} if self.online else {}
        if agreement_by_depth:
            metrics["drafter_agreement"] = agreement_by_depth
        return metrics

    def run_pass(self, target, forwards: list[DrafterInputs], tokens: float, learn: bool, measure: bool,
                 drafter=None) -> tuple[float, list[float | None]]:
        """One pass of `step` over a minibatch (a step's micro-batches, or some of their rows) holding `tokens`
        generated tokens: the loss when the drafter trains online, an optimizer step when `learn`, the agreement per
        depth when `measure` (and `drafter_train.agreement`); of `drafter` where given (a pass without gradient:
        the weights' average), else of the trained drafter."""
        drafter = self.drafter if drafter is None else drafter
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        if learn:
            self.drafter.train()
            self.opt.zero_grad(set_to_none=True)
        total, sums, counts = 0.0, [], []
        online_loss = drafter_method(self.method).online_loss
        for f in forwards:
            with torch.set_grad_enabled(learn):
                pairs = depth_pairs(online_loss, target, drafter, f.input_ids, f.mask, f.out, f.logits,
                                    self.cfg.drafts)
            # Summed per depth over micro-batches (a short one may have fewer depths).
            if measure and self.cfg.agreement:
                for i, (s, c) in enumerate(zip(*agreement(drafter, pairs, self.sampling))):
                    if i == len(sums):
                        sums.append(0.0)
                        counts.append(0.0)
                    sums[i] += s
                    counts[i] += c
            if self.online and pairs:  # none where every row's tokens left the update (rejected or stale)
                share = float(f.mask.sum()) / max(tokens, 1.0)
                with torch.set_grad_enabled(learn):
                    loss = self.cfg.loss_weight * share * pairs_loss(drafter, pairs)
                if learn:
                    loss.backward(inputs=params)
                total += float(loss.detach())
        if learn:
            self.optimizer_step()
            self.drafter.eval()
        return total, [s / c if c else None for s, c in zip(sums, counts)]

    def optimizer_step(self) -> None:
        """One optimizer step on the gradient the drafter holds: clipped (`MAX_GRAD_NORM`), then the average follows
        the trained weights (decay `drafter_train.ema`)."""
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), MAX_GRAD_NORM)
        self.opt.step()
        if self.ema is not None:
            with torch.no_grad():
                for avg, p in zip(self.ema.parameters(), self.drafter.parameters()):
                    avg.lerp_(p, 1.0 - self.cfg.ema)

    def state_dict(self) -> dict:
        """The optimizer's state, the average and the replayed states (for exact resume: the steps the next updates
        will re-read), under the keys a checkpoint of the embedded trainer holds them."""
        state = {}
        if self.opt is not None:
            state["drafter_opt"] = self.opt.state_dict()
        if self.ema is not None:
            state["drafter_ema"] = self.ema.state_dict()
        if self.replay.maxlen > 1:
            state["drafter_replay"] = [([f.copy_to("cpu") for f in fs], t) for fs, t in self.replay]
        return state

    def load_state_dict(self, state: dict, device) -> None:
        """What `state_dict` wrote (a key missing leaves that part as it is; the replay is emptied), the replayed
        states onto `device`."""
        if self.opt is not None and "drafter_opt" in state:
            self.opt.load_state_dict(state["drafter_opt"])
        if self.ema is not None and "drafter_ema" in state:
            self.ema.load_state_dict(state["drafter_ema"])
        self.replay.clear()
        self.replay.extend(([f.copy_to(device) for f in fs], t) for fs, t in state.get("drafter_replay", []))
