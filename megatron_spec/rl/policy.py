"""The embedded trainer: our model + AdamW, behind the same interface the Megatron backend will offer
(`logprobs`, `train_step`, `export_weights`, `state_dict` / `load_state_dict`).

Online drafter training rides on the policy's own forward in `train_step`: the drafter reads the trunk's hidden
states and logits *detached*, and has its own optimizer and its own backward, so its loss cannot send gradient
into the trunk (a test compares the trunk's gradients with and without it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.decoder import CausalLM
from ..models.eagle3 import Eagle3Head
from ..spec.drafter_loss import drafter_loss
from ..spec.sampling import processed_logprobs
from .grpo import aggregate, kl_k3, policy_loss
from .refit import named_weights


@dataclass
class Batch:
    input_ids: Tensor
    """[B, T] prompt + completion, right-padded."""
    mask: Tensor
    """[B, T] True at completion tokens (what the loss and the drafter learn)."""
    advantages: Tensor | None = None
    """[B] per-sequence advantage."""
    old_logprobs: Tensor | None = None
    """[B, T-1] log-probs of token t+1 under the policy before this update (from the logprob stage)."""


def token_logprobs(logits: Tensor, input_ids: Tensor, sampling: dict) -> Tensor:
    """[B, T-1]: log-prob of token t+1 under the processed distribution at t (the engine's exact processing)."""
    lp = processed_logprobs(logits[:, :-1], **sampling)
    return lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


class EmbeddedPolicy:
    def __init__(self, model: CausalLM, grpo, sampling: dict, drafter=None, drafter_method: str | None = None,
                 drafter_cfg=None):
        self.model = model.train()
        self.grpo = grpo
        self.sampling = sampling
        self.opt = torch.optim.AdamW(model.parameters(), lr=grpo.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.ref = None
        if grpo.kl_coef > 0:  # a frozen copy of the initial policy for the KL term
            self.ref = CausalLM(model.config)
            self.ref.load_state_dict(model.state_dict())
            self.ref.eval().requires_grad_(False)
        self.drafter, self.drafter_method, self.drafter_cfg = drafter, drafter_method, drafter_cfg
        self.drafter_opt = None
        if drafter is not None and drafter_cfg is not None and drafter_cfg.online:
            self.drafter_opt = torch.optim.AdamW(drafter.parameters(), lr=drafter_cfg.lr, weight_decay=0.0)

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> Tensor:
        return token_logprobs(self.model(batch.input_ids), batch.input_ids, self.sampling)

    def capture(self) -> tuple[int, ...]:
        return tuple(self.drafter.capture_layers) if isinstance(self.drafter, Eagle3Head) else ()

    def train_step(self, batch: Batch) -> dict:
        """One policy update on the batch; then, if online, one drafter update on the same forward's states."""
        self.model.train()
        out = self.model.trunk(batch.input_ids, capture=self.capture())
        logits = self.model.lm_head(out.hidden)
        logprobs = token_logprobs(logits, batch.input_ids, self.sampling)
        mask = batch.mask[:, 1:]
        loss, metrics = policy_loss(logprobs, batch.old_logprobs, batch.advantages, mask,
                                    self.grpo.clip_low, self.grpo.clip_high, self.grpo.loss_agg)
        if self.ref is not None:
            with torch.no_grad():
                ref_lp = token_logprobs(self.ref(batch.input_ids), batch.input_ids, self.sampling)
            kl = aggregate(kl_k3(logprobs, ref_lp), mask, self.grpo.loss_agg)
            loss = loss + self.grpo.kl_coef * kl
            metrics["kl"] = float(kl)
        aux = self.model.aux_loss
        if aux is not None:
            loss = loss + self.model.config.router_aux_loss_coef * aux
        metrics["loss"] = float(loss.detach())
        self.opt.zero_grad(set_to_none=True)
        if torch.isfinite(loss):
            loss.backward()
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grpo.max_grad_norm))
            self.opt.step()
            metrics["skipped"] = False
        else:
            metrics["skipped"] = True  # a NaN/inf loss never reaches the weights
        if self.drafter_opt is not None:
            metrics["drafter_loss"] = self.train_drafter(batch, out, logits)
        return metrics

    def train_drafter(self, batch: Batch, out, logits: Tensor) -> float:
        self.drafter.train()
        loss = self.drafter_cfg.loss_weight * drafter_loss(
            self.drafter_method, self.model, self.drafter, batch.input_ids, batch.mask, out, logits.detach())
        self.drafter_opt.zero_grad(set_to_none=True)
        loss.backward(inputs=[p for p in self.drafter.parameters() if p.requires_grad])
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.drafter_opt.step()
        self.drafter.eval()
        return float(loss.detach())

    def export_weights(self):
        return named_weights(self.model, self.drafter)

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        if self.drafter is not None:
            state["drafter"] = self.drafter.state_dict()
        if self.drafter_opt is not None:
            state["drafter_opt"] = self.drafter_opt.state_dict()
        if self.ref is not None:
            state["ref"] = self.ref.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        for key, obj in (("drafter", self.drafter), ("drafter_opt", self.drafter_opt), ("ref", self.ref)):
            if obj is not None and key in state:
                obj.load_state_dict(state[key])
