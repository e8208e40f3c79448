"""The embedded trainer: our model + AdamW, a `megatron_spec.interfaces.Policy` as the Megatron trainer is.

Online drafter training rides on the policy's own forward in `train_step`: the drafter reads the trunk's hidden
states and logits *detached*, and its trainer (`drafters.trainer.DrafterTrainer`) has its own optimizer and its own
backward, so its loss cannot send gradient into the trunk (a test compares the trunk's gradients with and without
it).

Both forwards run over length-bucketed micro-batches (`microbatch.py`) with the whole batch's loss denominators, so
a step's update is the one-big-batch update without the padding. With one update per step, the behaviour log-probs
can come from the train forward itself (`Batch.old_logprobs` None), which removes the recompute forward. The G
rollouts of a GRPO group share their prompt, which both forwards compute once per step (`prefix.py`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import Tensor

from ..models.decoder import CausalLM, TrunkOutput
from ..drafters.eagle3.model import captured_layers
from ..models.routing import replayed
from ..drafters.trainer import Deadline, DrafterTrainer
from ..speculative.sampling import processed_logprobs
from ..rl.grpo import LossNorm, aggregate, kl_penalty, policy_loss, truncated_is_weights
from ..microbatch import micro_batches, sequence_lengths
from ..rl.prefix import SharedPrompts, prompt_groups
from ..refit import named_weights, tensor_set_key
from ..interfaces import Batch, DrafterInputs


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
        self.drafter = drafter
        self.drafter_trainer = None  # the drafter's online training and agreement (`drafters.trainer`)
        if drafter is not None and drafter_cfg is not None:
            self.drafter_trainer = DrafterTrainer(drafter, drafter_method, drafter_cfg, sampling,
                                                  grpo.micro_batch_tokens)
        # The drafter reads this step's forwards to train (online) and/or to measure its agreement.
        self.drafter_reads = self.drafter_trainer is not None and self.drafter_trainer.reads

    supports_step_gate = True

    @property
    def trains_drafter_online(self) -> bool:
        return self.drafter_trainer is not None and self.drafter_trainer.online and self.drafter_reads

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
            if drafter_extra is not None and self.drafter_trainer.online:
                extra = self.drafter_states(drafter_extra, deadline)
                forwards += extra
                tokens += sum(float(f.mask.sum()) for f in extra)
            metrics.update(self.drafter_trainer.step(self.model, forwards, tokens, deadline))
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

    def _exported_drafter(self):
        return self.drafter if self.drafter_trainer is None else self.drafter_trainer.drafting

    def export_weights(self):
        return named_weights(self.model, self._exported_drafter())

    def refit_key(self) -> tuple:
        """The exported tensor set (`refit.tensor_set_key`): the policy and the drafter the engines draft with."""
        return tensor_set_key(self.model, self._exported_drafter())

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        if self.drafter is not None:
            state["drafter"] = self.drafter.state_dict()
        if self.drafter_trainer is not None:  # its optimizer, average and replayed steps
            state.update(self.drafter_trainer.state_dict())
        if self.ref is not None:
            state["ref"] = self.ref.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        for key, obj in (("drafter", self.drafter), ("ref", self.ref)):
            if obj is not None and key in state:
                obj.load_state_dict(state[key])
        if self.drafter_trainer is not None:
            self.drafter_trainer.load_state_dict(state, self.model.device)
