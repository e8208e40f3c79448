"""The Megatron trainer's optimizer: one update of this rank's shards from the gradients of a train step, the
policy and the MTP layers clipped apart (so a detached MTP head leaves the policy update exactly as without it).

`torch`: torch's AdamW on each rank's shards with the embedded trainer's settings (policy: `grpo.lr`, betas
(0.9, 0.99); MTP layers: `drafter_train.lr`, torch's default betas, as the embedded drafter), after the gradients
are reduced (`step.reduce_grads`) and clipped, policy and MTP layers separately (`grpo.max_grad_norm`, 1.0). With
bfloat16 parameters it works on fp32 master copies of this rank's shards (gradients converted to fp32 before
clipping, the update copied back rounded to bf16), so the weights and Adam moments keep fp32 precision and only
the forward / backward run in bf16.

`megatron`: Megatron-Core's distributed optimizer (Megatron's DDP with fp32 gradient buffers, fp32 masters and Adam
states sharded over data parallel), CUDA only (the policy refuses it elsewhere before anything is built). It keeps
the same contract: the MTP layers are their own parameter groups in the one optimizer (`drafter_train.lr`, torch's
default betas) and are clipped apart from the policy (`ShardOptimizer._megatron_step`).
"""

from __future__ import annotations

import torch

from ...drafters.trainer import MAX_GRAD_NORM
from .step import clip, is_mtp, named_chunks, norm_owned, reduce_grads

MTP_MAX_GRAD_NORM = MAX_GRAD_NORM
"""The MTP layers' gradient clip: the online drafter trainer's (`drafters.trainer`)."""
MTP_BETAS = (0.9, 0.999)
"""The MTP layers' Adam betas: torch's default, as the online drafter trainer's."""


class ShardOptimizer:
    """This rank's optimizer of kind `kind` (torch | megatron) over the model `chunks` (`model`: them as one
    module). `masters`: each parameter's fp32 master (the parameter itself where it is fp32, or where Megatron's
    optimizer keeps its own); `opt`: torch's AdamW, or `ddp` and `mopt`: Megatron-Core's. `clip_mtp`: the run has
    MTP layers (on every rank, with or without MTP layers on its stage: the clipping is collective)."""

    def __init__(self, model, chunks: list, kind: str, dtype: torch.dtype, lr: float, max_grad_norm: float,
                 drafter_lr: float, clip_mtp: bool):
        self.kind, self.chunks, self.max_grad_norm, self.clip_mtp = kind, chunks, max_grad_norm, clip_mtp
        named = named_chunks(chunks)
        # fp32 master copies of low-precision shards: the optimizer updates these, the model gets them rounded.
        self.masters = {p: (p if p.dtype == torch.float32 or kind != "torch"
                            else torch.nn.Parameter(p.detach().float().clone())) for _, p in named}
        self.trunk = [(n, p) for n, p in named if not is_mtp(n)]
        self.mtp_layers = [(n, p) for n, p in named if is_mtp(n)]
        self.owned = norm_owned(chunks)
        groups = [dict(params=[self.masters[p] for _, p in self.trunk], lr=lr, betas=(0.9, 0.99))]
        if self.mtp_layers:
            groups.append(dict(params=[self.masters[p] for _, p in self.mtp_layers], lr=drafter_lr))
        self.opt = torch.optim.AdamW(groups, weight_decay=0.0) if kind == "torch" else None
        self.ddp = self.mopt = None
        if kind == "megatron":
            self._megatron_optimizer(model, dtype, lr, drafter_lr)

    def zero_grad(self) -> None:
        if self.mopt is not None:
            self.ddp.zero_grad_buffer()
            self.mopt.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=True)

    def step(self) -> tuple[bool, float]:
        """Reduce, clip and apply the gradients of a backward pass: (updated, the policy's gradient norm before
        clipping; nan where Megatron's optimizer reports none). Not updated: Megatron's optimizer found an inf / nan
        gradient. Collective."""
        if self.mopt is not None:  # Megatron-Core: reduce(-scatter) in fp32, clip, step the sharded fp32 masters
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            if self.clip_mtp:  # every rank, with or without MTP layers on its stage
                updated, grad_norm = self._megatron_step()
            else:
                updated, grad_norm, _ = self.mopt.step()
            return updated, float(grad_norm) if grad_norm is not None else float("nan")
        for chunk in self.chunks:
            reduce_grads(chunk)
        self._grads_to_masters()
        grad_norm = clip(self._master_named(self.trunk), self.owned, self.max_grad_norm)
        if self.clip_mtp:  # collective: stages without MTP layers take part with nothing
            clip(self._master_named(self.mtp_layers), self.owned, MTP_MAX_GRAD_NORM)
        self.opt.step()
        self.masters_to_params()
        return True, grad_norm

    def adam_step(self) -> float:
        """Adam's step count (torch keeps it per parameter; in Megatron-Core's optimizer TE / Apex keep it per
        group, torch per parameter)."""
        if self.mopt is None:
            return max((float(s["step"]) for s in self.opt.state.values() if "step" in s), default=0.0)
        steps = []
        for sub in self.subs():
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            steps += [float(g["step"]) for g in inner.param_groups if g["params"] and "step" in g]
            steps += [float(s["step"]) for s in inner.state.values() if "step" in s]
        return max(steps, default=0.0)

    def torch_only(self, what: str) -> None:
        """Refuse `what` with Megatron's optimizer, whose states are not held per HF-named tensor."""
        if self.mopt is not None:
            raise NotImplementedError(f"{what} (full HF-named tensors) with backend.megatron.optimizer=megatron is "
                                      "not wired; its checkpoint is save_sharded / load_sharded")

    # -- fp32 masters -----------------------------------------------------------------------------------------

    def _master_named(self, named):
        return [(n, self.masters[p]) for n, p in named]

    def _grads_to_masters(self) -> None:
        for p, m in self.masters.items():
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Copy the fp32 masters into the low-precision parameters (after a step or a load of the masters)."""
        for p, m in self.masters.items():
            if m is not p:
                p.copy_(m)

    # -- Megatron-Core's distributed optimizer ----------------------------------------------------------------

    def _megatron_optimizer(self, model, dtype: torch.dtype, lr: float, drafter_lr: float) -> None:
        """Megatron-Core's distributed optimizer (CUDA only; checked by the policy): the model in Megatron's DDP
        (gradients accumulated and reduce-scattered in fp32 buffers), Adam with the embedded trainer's settings over
        fp32 masters sharded across the data-parallel ranks. Megatron's global gradient clipping without MTP layers.

        MTP layers: Megatron's own parameter-group overrides (`config_overrides`, megatron-core 0.16) give them
        their own groups with `lr` = `drafter_lr` and torch's default betas, set on the group itself (no learning-rate
        scheduler runs; `max_lr` / `min_lr` say the same for one that would). The groups are marked
        `is_decoupled_lr`, one of the keys Megatron matches groups by when it loads a checkpoint, so a policy group
        and an MTP group with otherwise equal keys never swap their settings. One optimizer steps both, but
        `_megatron_step` clips the policy groups and the MTP groups each by their own norm, as the torch path does."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import (
            OptimizerConfig, ParamKey, ParamPredicate, get_megatron_optimizer, get_standard_config_overrides,
        )

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.0,
                                     adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8,
                                     bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                     use_distributed_optimizer=True, clip_grad=self.max_grad_norm)
        overrides = None
        if self.clip_mtp:  # every rank: Megatron aligns the parameter groups across ranks
            overrides = get_standard_config_overrides(opt_config)  # what Megatron applies when given none
            mtp_ids = {id(p) for _, p in self.mtp_layers}
            mtp_key = ParamKey(predicate=ParamPredicate(name="mtp_layers", fn=lambda p: id(p) in mtp_ids))
            overrides[mtp_key] = dict(lr=drafter_lr, max_lr=drafter_lr, min_lr=drafter_lr, betas=MTP_BETAS,
                                      is_decoupled_lr=True)
        self.mopt = get_megatron_optimizer(opt_config, [self.ddp], config_overrides=overrides)
        self.masters = {p: p for p in self.masters}  # the optimizer keeps its own (sharded) fp32 copies

    def subs(self) -> list:
        """Megatron-Core's sub-optimizers (a chained optimizer's, or the one)."""
        return list(getattr(self.mopt, "chained_optimizers", [self.mopt]))

    @torch.no_grad()
    def _megatron_step(self) -> tuple[bool, float]:
        """Megatron-Core's optimizer step with the policy groups and the MTP groups clipped apart: (updated, the
        policy's gradient norm before clipping). Megatron's `step` with its norm split in two: the main gradients
        are prepared (`prepare_grads`), each part's norm is taken over what Megatron's own norm counts (this rank's
        shard, no tied copy twice, no tensor-parallel duplicate), reduced over the optimizer's group, and each
        part is clipped by its own norm before the update (`step_with_ready_grads`). Collective: every rank goes
        through every sub-optimizer and part, with or without parameters of it."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        if self.mopt.prepare_grads():  # an inf / nan main gradient (checked only under a loss scale)
            return False, None
        norms = []
        for mtp, max_norm in ((False, self.max_grad_norm), (True, MTP_MAX_GRAD_NORM)):
            parts, squares = [], 0.0
            for sub in self.subs():
                params = _group_params(sub, mtp)
                tp = getattr(sub, "tp_group", None)
                grads = [p.grad for p in params if p.grad is not None and param_is_not_shared(p)
                         and param_is_not_tensor_parallel_duplicate(p, tp)]
                squares += get_grad_norm_fp32(grads, grad_stats_parallel_group=sub.get_grad_stats_parallel_group()) ** 2
                parts.append(params)
            norm = squares ** 0.5
            for params in parts:
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm, norm)
            norms.append(norm)
        return self.mopt.step_with_ready_grads(), norms[0]


def _group_params(sub, mtp: bool) -> list:
    """The main parameters of one Megatron sub-optimizer's MTP groups (`mtp`) or policy groups (the MTP groups are
    the ones marked `is_decoupled_lr`, `_megatron_optimizer`); none for a rank without parameters in it."""
    inner = None if getattr(sub, "is_stub_optimizer", False) else getattr(sub, "optimizer", None)
    groups = inner.param_groups if inner is not None else []
    return [p for g in groups if bool(g.get("is_decoupled_lr", False)) == mtp for p in g["params"]]
