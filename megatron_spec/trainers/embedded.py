"""The embedded trainer: our model + AdamW, a `megatron_spec.interfaces.Policy` as the Megatron trainer is.

Online drafter training rides on the policy's own forward in `train_step`: the drafter reads the trunk's hidden
states and logits *detached*, and has its own optimizer and its own backward, so its loss cannot send gradient
into the trunk (a test compares the trunk's gradients with and without it).

Both forwards run over length-bucketed micro-batches (`microbatch.py`) with the whole batch's loss denominators, so
a step's update is the one-big-batch update without the padding. With one update per step, the behaviour log-probs
can come from the train forward itself (`Batch.old_logprobs` None), which removes the recompute forward. The G
rollouts of a GRPO group share their prompt, which both forwards compute once per step (`prefix.py`).
"""

from __future__ import annotations

import copy
import time
from collections import deque
from contextlib import contextmanager

import torch
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..drafters.eagle3.model import captured_layers
from ..models.routing import replayed
from ..drafters.loss import agreement, depth_pairs, pairs_loss
from ..drafters.registry import drafter_method
from ..interfaces import Batch, DrafterInputs
from ..speculative.sampling import processed_logprobs
from ..rl.grpo import LossNorm, aggregate, kl_penalty, policy_loss, truncated_is_weights
from ..rl.microbatch import micro_batches, sequence_lengths
from ..rl.prefix import SharedPrompts, prompt_groups
from ..rl.refit import named_weights


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
    return DrafterInputs(cat([p.input_ids for p in parts]), cat([p.mask for p in parts]),
                         TrunkOutput(cat([p.out.hidden for p in parts]), layers), cat([p.logits for p in parts]))


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


def token_logprobs(logits: Tensor, input_ids: Tensor, sampling: dict) -> Tensor:
    """[B, T-1]: log-prob of token t+1 under the processed distribution at t (the engine's exact processing)."""
    lp = processed_logprobs(logits[:, :-1], **sampling)
    return lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """`values` with every position outside `mask` set to 0. Under top-k / top-p a padding position's log-prob can
    be -inf, and -inf - (-inf) is NaN, which a 0-weight in the loss does not remove (0 * NaN = NaN, in the backward
    too); `where` passes neither the value nor a gradient through the zeroed positions."""
    return torch.where(mask, values, 0.0)


def grpo_micro_loss(logits: Tensor, mb: Batch, old_logprobs: Tensor | None, sampling: dict, grpo,
                    norm: LossNorm) -> tuple[Tensor, dict, Tensor]:
    """One micro-batch's share of the GRPO surrogate (`grpo.policy_loss` with the whole batch's `norm`), from the
    policy's logits over `mb`: (loss, metrics, the processed log-probs [b, t-1] with their gradient, 0 outside the
    mask). `old_logprobs` None folds the ratio's old log-probs into this forward (detached). Rollouts that carry
    behaviour log-probs of an older policy version (async GRPO) are weighted by importance ratios at
    `grpo.rollout_correction`'s level and truncation (whole rows sit in one micro-batch, so a sequence's ratio is
    its own here), and the truncated share of the tokens is `is_clip_frac`. Every trainer computes its loss through
    this one function."""
    mask = mb.mask[:, 1:]
    logprobs = masked(token_logprobs(logits, mb.input_ids, sampling), mask)
    old = logprobs.detach() if old_logprobs is None else masked(old_logprobs, mask)
    weights = None
    if mb.behaviour_logprobs is not None:
        rc = grpo.rollout_correction
        weights, truncated = truncated_is_weights(old, masked(mb.behaviour_logprobs, mask), rc.truncate, mask,
                                                  rc.level)
    loss, metrics = policy_loss(logprobs, old, mb.advantages, mask, grpo.clip_low, grpo.clip_high, grpo.loss_agg,
                                norm, weights, grpo.dual_clip_c, grpo.ratio_level)
    if weights is not None:
        metrics["is_clip_frac"] = float(aggregate(truncated.float(), mask, "token", norm))
    return loss, metrics, logprobs


class EmbeddedPolicy:
    """The `Policy` of one process: the policy model, its AdamW, and the drafter's online training."""

    def __init__(self, model: CausalLM, grpo, sampling: dict, drafter=None, drafter_method: str | None = None,
                 drafter_cfg=None):
        self.model = model.train()
        self.grpo = grpo
        self.sampling = sampling
        self.opt = torch.optim.AdamW(model.parameters(), lr=grpo.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.ref = None
        if grpo.kl_coef > 0:  # a frozen copy of the initial policy for the KL term
            self.ref = CausalLM(model.config).to(model.device)
            self.ref.load_state_dict(model.state_dict())
            self.ref.eval().requires_grad_(False)
        self.drafter, self.drafter_method, self.drafter_cfg = drafter, drafter_method, drafter_cfg
        self.drafter_opt = self.drafter_ema = None
        if drafter is not None and drafter_cfg is not None and drafter_cfg.online:
            self.drafter_opt = torch.optim.AdamW(drafter.parameters(), lr=drafter_cfg.lr, weight_decay=0.0)
            if drafter_cfg.ema:  # the weights that draft (refit into the generator): the trained ones' average
                self.drafter_ema = copy.deepcopy(drafter).requires_grad_(False).eval()
        # The last `drafter_train.replay` steps' detached states, oldest first: (micro-batches, generated tokens).
        self.replay: deque[tuple[list[DrafterInputs], float]] = deque(maxlen=drafter_cfg.replay if drafter_cfg else 1)
        # The drafter reads this step's forwards to train (online) and/or to measure its agreement.
        self.drafter_reads = self.drafter_opt is not None or (
            drafter is not None and drafter_cfg is not None and drafter_cfg.agreement)

    supports_step_gate = True

    @property
    def trains_drafter_online(self) -> bool:
        return self.drafter_opt is not None and self.drafter_reads

    @contextmanager
    def speculation(self, enabled: bool):
        """With `enabled` False, `train_step` inside the block leaves the drafter out (no update, no agreement), as
        a run without speculation trains: the whole-step gate's plain steps."""
        if enabled:
            yield
            return
        saved, self.drafter_reads = self.drafter_reads, False
        try:
            yield
        finally:
            self.drafter_reads = saved

    @classmethod
    def from_rl(cls, cfg, model: CausalLM, drafter=None) -> "EmbeddedPolicy":
        g = cfg.grpo
        sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        return cls(model, g, sampling, drafter, cfg.spec.method if cfg.spec else None, cfg.drafter_train)

    def split(self, batch: Batch) -> list[tuple[list[int], Batch]]:
        """The batch's length-bucketed micro-batches (`grpo.micro_batch_tokens`), each with its row indices.

        Cut on full row lengths with or without shared prompts: the suffix pass's padded size (completions only)
        then stays within the budget as well. Counting completion lengths instead makes the micro-batches larger by
        about the prompt's share, and the greedy cut pads more: measured on the tiny recipe's batches (2 threads),
        the shared train step took 0.96 of the unshared one's time that way, 0.90 this way."""
        lengths = sequence_lengths(batch.mask)
        groups = micro_batches(lengths, self.grpo.micro_batch_tokens)
        return [(rows, batch.select(rows, max(lengths[r] for r in rows))) for rows in groups]

    def share(self, batch: Batch, capture: tuple[int, ...] = ()) -> SharedPrompts | None:
        """The batch's prefix pass (`prefix.py`) when prompts are shared: `grpo.share_prompt` on, a dense model, and
        some prompt held by several rows (otherwise there is nothing to save). Not for MoE: its load-balancing loss
        is a statistic of the tokens each forward routes, and counting a prompt once instead of once per rollout
        changes it."""
        if not self.grpo.share_prompt or self.model.config.is_moe:
            return None
        groups = prompt_groups(batch.input_ids, batch.mask)
        return SharedPrompts(self.model, batch.input_ids, batch.mask, groups, capture) if groups.repeated else None

    def trunk(self, mb: Batch, rows: list[int], shared: SharedPrompts | None,
              capture: tuple[int, ...] = ()) -> TrunkOutput:
        """The trunk's output over the micro-batch `mb` (`rows` of the batch), through the shared prompts if any (which
        capture the layers they were built with; `capture` is for the unshared forward)."""
        if shared is None:
            with replayed(self.model, mb.routing):
                return self.model.trunk(mb.input_ids, capture=capture)
        return shared.trunk(rows, mb.input_ids.shape[1])  # dense models only: nothing to replay

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> Tensor:
        """[B, T-1] log-prob of each next token (0 outside the completion mask), one forward per micro-batch; through
        the same shared prompts and micro-batches as `train_step`, so a folded step gives these numbers exactly.
        Computed on the model's device, returned on the host (where the batch came from)."""
        batch = batch.to(self.model.device)
        B, T = batch.mask.shape
        out = torch.zeros(B, T - 1, device=batch.mask.device)
        shared = self.share(batch)
        for rows, mb in self.split(batch):
            logits = self.model.lm_head(self.trunk(mb, rows, shared).hidden)
            lp = token_logprobs(logits, mb.input_ids, self.sampling)
            out[rows, : lp.shape[1]] = masked(lp, mb.mask[:, 1:])
        return out.cpu()

    def capture(self) -> tuple[int, ...]:
        return captured_layers(self.drafter)

    @torch.no_grad()
    def drafter_states(self, batch: Batch, deadline: Deadline | None = None) -> list[DrafterInputs]:
        """What the drafter update reads, per micro-batch, from a forward of the policy as it is now, without
        gradient (rows the policy does not train on: `drafter_train.extra_groups`); the micro-batches reached before
        the `deadline` passes."""
        batch = batch.to(self.model.device)
        states = []
        for _, mb in self.split(batch):
            if deadline is not None and deadline.stops():
                break
            out = self.trunk(mb, [], None, self.capture())
            states.append(DrafterInputs(mb.input_ids, mb.mask, out, self.model.lm_head(out.hidden)))
        return states

    def train_step(self, batch: Batch, drafter_extra: Batch | None = None,
                   drafter_budget_s: float | None = None) -> dict:
        """One policy update on the batch, then, if online, one drafter update on the same forwards' states (and on
        `drafter_extra`'s, from a forward without gradient after the update), cut short once it has taken
        `drafter_budget_s` seconds (`Deadline`; `drafter_cut` in the metrics).

        The gradient is accumulated over length-bucketed micro-batches, each aggregated with the whole batch's
        denominators (`LossNorm`), so the update is the one-big-batch update (up to fp32 summation order); one
        optimizer step, clipped after accumulation. With `batch.old_logprobs` None the ratio's "old" log-probs are
        this forward's own, detached: exact when this is the step's only update, since nothing has moved since the
        rollouts' refit (`grpo.fold_logprob`); they are written into `batch.old_logprobs` for the caller's metrics.
        With `grpo.share_prompt` each distinct prompt goes through the trunk once (`prefix.py`): the micro-batches'
        backward passes stop at the prompts' states, and one backward through the prompts follows the last of them.
        The step computes on the model's device; folded old log-probs come back to the host batch.
        """
        host, batch = batch, batch.to(self.model.device)
        self.model.train()
        shared = self.share(batch, self.capture())
        parts = self.split(batch)  # before old_logprobs is filled in: a micro-batch without them folds
        mask = batch.mask[:, 1:]
        norm = LossNorm.of(mask)
        fold = batch.old_logprobs is None
        if fold:
            batch.old_logprobs = torch.zeros(mask.shape, device=mask.device)
        positions = sum(mb.input_ids.numel() for _, mb in parts)  # MoE only (which never shares prompts)
        self.opt.zero_grad(set_to_none=True)
        metrics: dict = {}
        finite, forwards = True, []
        for rows, mb in parts:
            out = self.trunk(mb, rows, shared, self.capture())
            loss, mb_metrics, logprobs, drafter_inputs = self.micro_loss(mb, out, norm,
                                                                         mb.input_ids.numel() / positions)
            if fold:
                batch.old_logprobs[rows, : logprobs.shape[1]] = logprobs
            finite = finite and bool(torch.isfinite(loss))
            if finite:  # one non-finite micro-batch makes the whole loss non-finite: no more backward passes
                loss.backward()
            for k, v in mb_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
            if drafter_inputs is not None:
                forwards.append(drafter_inputs)
        if finite:
            if shared is not None:  # the prompts' gradient, summed over every micro-batch, through the prefix pass
                shared.backward()
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grpo.max_grad_norm))
            self.opt.step()
            metrics["skipped"] = False
        else:
            self.opt.zero_grad(set_to_none=True)  # a NaN/inf loss never reaches the weights
            metrics["skipped"] = True
        if self.drafter_reads:
            started, deadline = time.perf_counter(), Deadline(drafter_budget_s)
            tokens = float(batch.mask.sum())
            if drafter_extra is not None and self.drafter_opt is not None:
                extra = self.drafter_states(drafter_extra, deadline)
                forwards += extra
                tokens += sum(float(f.mask.sum()) for f in extra)
            metrics.update(self.drafter_step(forwards, tokens, deadline))
            metrics["drafter_s"] = time.perf_counter() - started  # the drafter's share of the train stage
            if deadline.stopped:
                metrics["drafter_cut"] = True
        if fold:
            host.old_logprobs = batch.old_logprobs.cpu()
        return metrics

    def micro_loss(self, mb: Batch, out: TrunkOutput, norm: LossNorm,
                   aux_share: float) -> tuple[Tensor, dict, Tensor, DrafterInputs | None]:
        """This micro-batch's share of the step's loss (policy + KL + MoE aux) and of its metrics, its detached
        log-probs [b, t-1] (0 outside the mask), and what the drafter update will need from this forward; `out` is
        the trunk's output over `mb` (`trunk`).

        The MoE load-balancing loss is a product of two batch means (routed share x mean router probability), so
        no split of it adds up exactly; each micro-batch's own is weighted by its share of the forwarded positions
        (Megatron's per-micro-batch convention). With a single micro-batch it is the one-big-batch value.
        """
        logits = self.model.lm_head(out.hidden)
        mask = mb.mask[:, 1:]
        loss, metrics, logprobs = grpo_micro_loss(logits, mb, mb.old_logprobs, self.sampling, self.grpo, norm)
        if self.ref is not None:
            with torch.no_grad():
                ref_lp = masked(token_logprobs(self.ref(mb.input_ids), mb.input_ids, self.sampling), mask)
            kl = aggregate(kl_penalty(logprobs, ref_lp, self.grpo.kl_estimator), mask, self.grpo.loss_agg, norm)
            loss = loss + self.grpo.kl_coef * kl
            metrics["kl"] = float(kl.detach())
        aux = self.model.aux_loss
        if aux is not None:
            loss = loss + self.model.config.router_aux_loss_coef * aux_share * aux
        metrics["loss"] = float(loss.detach())
        drafter_inputs = None
        if self.drafter_reads:
            detached = TrunkOutput(out.hidden.detach(), {i: h.detach() for i, h in out.layers.items()})
            drafter_inputs = DrafterInputs(mb.input_ids, mb.mask, detached, logits.detach())
        return loss, metrics, logprobs.detach(), drafter_inputs

    def drafter_step(self, forwards: list[DrafterInputs], tokens: float, deadline: Deadline | None = None) -> dict:
        """The drafter's update after the policy's (the MTP / EAGLE-3 heads read the trunk's embedding and output
        head as they are now, as before bucketing), and the drafter's agreement with the policy on this batch
        (`drafter_loss.agreement`); a frozen drafter only measures, without gradient.

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
        online = self.drafter_opt is not None
        batches = [(forwards, tokens)]
        if online:
            self.replay.append((forwards, tokens))
            one_pass = [mb for f, t in self.replay
                        for mb in minibatches(f, t, self.drafter_cfg.minibatches, self.grpo.micro_batch_tokens)]
            batches = one_pass * self.drafter_cfg.updates
        drafting = self.drafter if self.drafter_ema is None else self.drafter_ema
        measured = None
        if batches[0][0] is not forwards or drafting is not self.drafter:
            measured = self.drafter_pass(forwards, tokens, learn=False, measure=True, drafter=drafting)
        passes = []
        for i, (f, t) in enumerate(batches):
            if (passes or measured is not None) and deadline is not None and deadline.stops():
                break
            passes.append(self.drafter_pass(f, t, learn=online, measure=measured is None and i == 0))
        loss, agreement_by_depth = measured or passes[0]
        metrics = {"drafter_loss": loss} if online else {}
        if agreement_by_depth:
            metrics["drafter_agreement"] = agreement_by_depth
        return metrics

    def drafter_pass(self, forwards: list[DrafterInputs], tokens: float, learn: bool, measure: bool,
                     drafter=None) -> tuple[float, list[float | None]]:
        """One pass of `drafter_step` over a minibatch (a step's micro-batches, or some of their rows) holding
        `tokens` generated tokens: the loss when the drafter trains online, an optimizer step when `learn`, the
        agreement per depth when `measure` (and `drafter_train.agreement`); of `drafter` where given (a pass
        without gradient: the weights' average), else of the trained drafter."""
        online = self.drafter_opt is not None
        drafter = self.drafter if drafter is None else drafter
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        if learn:
            self.drafter.train()
            self.drafter_opt.zero_grad(set_to_none=True)
        total, sums, counts = 0.0, [], []
        online_loss = drafter_method(self.drafter_method).online_loss
        for f in forwards:
            with torch.set_grad_enabled(learn):
                pairs = depth_pairs(online_loss, self.model, drafter, f.input_ids, f.mask, f.out, f.logits,
                                    self.drafter_cfg.drafts)
            # Summed per depth over micro-batches (a short one may have fewer depths).
            if measure and self.drafter_cfg.agreement:
                for i, (s, c) in enumerate(zip(*agreement(drafter, pairs, self.sampling))):
                    if i == len(sums):
                        sums.append(0.0)
                        counts.append(0.0)
                    sums[i] += s
                    counts[i] += c
            if online and pairs:  # none where every row's tokens left the update (rejected or stale)
                share = float(f.mask.sum()) / max(tokens, 1.0)
                with torch.set_grad_enabled(learn):
                    loss = self.drafter_cfg.loss_weight * share * pairs_loss(drafter, pairs)
                if learn:
                    loss.backward(inputs=params)
                total += float(loss.detach())
        if learn:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self.drafter_opt.step()
            self.drafter.eval()
            if self.drafter_ema is not None:
                with torch.no_grad():
                    for avg, p in zip(self.drafter_ema.parameters(), self.drafter.parameters()):
                        avg.lerp_(p, 1.0 - self.drafter_cfg.ema)
        return total, [s / c if c else None for s, c in zip(sums, counts)]

    def export_weights(self):
        return named_weights(self.model, self.drafter if self.drafter_ema is None else self.drafter_ema)

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        if self.drafter is not None:
            state["drafter"] = self.drafter.state_dict()
        if self.drafter_opt is not None:
            state["drafter_opt"] = self.drafter_opt.state_dict()
        if self.drafter_ema is not None:
            state["drafter_ema"] = self.drafter_ema.state_dict()
        if self.replay.maxlen > 1:  # exact resume: the steps the next updates will re-read
            state["drafter_replay"] = [([f.copy_to("cpu") for f in fs], t) for fs, t in self.replay]
        if self.ref is not None:
            state["ref"] = self.ref.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        for key, obj in (("drafter", self.drafter), ("drafter_opt", self.drafter_opt), ("drafter_ema", self.drafter_ema),
                         ("ref", self.ref)):
            if obj is not None and key in state:
                obj.load_state_dict(state[key])
        self.replay.clear()
        self.replay.extend(([f.copy_to(self.model.device) for f in fs], t) for fs, t in state.get("drafter_replay", []))
