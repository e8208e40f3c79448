"""`MegatronPolicy`: the Policy interface (`logprobs`, `train_step`, `export_weights`, `state_dict` /
`load_state_dict`) on a Megatron-Core `GPTModel` split over TP / PP / EP, with the MTP head as Megatron's own MTP
layers trained in the same backward and optimizer step.

Every rank holds one `MegatronPolicy` and every method is collective. Either every rank makes the same calls
(SPMD, `followers=False`: the tests), or, for the RL loop, which runs on rank 0 only and never sees
torch.distributed, rank 0's calls are first announced to the other ranks (`_announce`: method name and arguments,
one broadcast), which wait in `follow()` and make the same call (`from_rl` sets `followers`; `launch.py` starts
the ranks). A single process (world size 1) is the same code without announcements.

Optimizer: torch's AdamW on each rank's shards with the embedded trainer's settings (policy: `grpo.lr`, betas
(0.9, 0.99); MTP layers: `drafter_train.lr`, torch's default betas, as the embedded drafter), after the
gradients are reduced (`step.reduce_grads`) and clipped, policy and MTP layers separately (`grpo.max_grad_norm`,
1.0), so a detached MTP head leaves the policy update exactly as without it. Megatron's own (distributed)
optimizer needs CUDA; it is not wired in yet.

Checkpoints hold full HF-named tensors (weights and both Adam moments, gathered by the exporter), so a run saved
at one TP / PP / EP layout resumes at another; every rank imports its own shards back. That gathers the whole
model on rank 0: fine for the toy sizes here, not for 235B (Megatron's distributed checkpointing is the way there).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_spec.models import MTP, CausalLM, MTPConfig
from megatron_spec.rl.grpo import LossNorm
from megatron_spec.rl.policy import Batch
from megatron_spec.rl.refit import DRAFTER_PREFIX

from . import require_megatron
from .checks import Parallelism, check_parallelism
from .exporter import DEFAULT_BUCKET_BYTES, export_hf
from .importer import import_hf
from .parallel import ensure_process_group, init_model_parallel
from .provider import build_model
from .step import (
    StepSpec, aux_loss_sum, clip, gather_rows, is_mtp, norm_owned, plan, reduce_grads, reset_router_tracker, run_schedule,
    sum_metrics,
)

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402

STOP = "__stop__"
BUILD = "__build__"
OPT_STATES = ("exp_avg", "exp_avg_sq")


def hf_weights(model: CausalLM, drafter) -> dict[str, torch.Tensor]:
    """HF-named tensors of the policy (tied head once) and of an MTP drafter (`mtp.layers.*`)."""
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if drafter is not None:
        tensors.update(drafter.state_dict())
    return {n: t.detach().float() for n, t in tensors.items()}


class MegatronPolicy:
    def __init__(self, model: CausalLM, grpo, sampling: dict, par: Parallelism, *, drafter=None,
                 mtp_num_layers: int = 0, mtp_coupling: str = "detached", mtp_loss_scaling_factor: float = 0.1,
                 drafter_lr: float = 3e-4, sequence_parallel: bool = False, seed: int = 0, followers: bool = False):
        cfg = model.config
        if grpo.kl_coef > 0:
            raise NotImplementedError("the Megatron trainer has no reference model yet: use grpo.kl_coef=0")
        if par.cp > 1:
            raise NotImplementedError("context parallelism (cp > 1) is not wired into the Megatron trainer yet")
        if mtp_num_layers and drafter is not None and not isinstance(drafter, MTP):
            raise ValueError(f"backend.megatron.mtp_num_layers={mtp_num_layers} trains an MTP head, but the drafter "
                             f"is a {type(drafter).__name__}")
        if mtp_num_layers and drafter is not None and drafter.mtp_config.num_layers != mtp_num_layers:
            raise ValueError(f"the MTP drafter has {drafter.mtp_config.num_layers} layer(s), "
                             f"backend.megatron.mtp_num_layers={mtp_num_layers}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_parallelism(cfg, par, world)  # before any rank allocates a parameter
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed initialised on every rank "
                               "(backends.megatron.launch starts it; tests use parallel.spawn)")
        self.grpo, self.sampling, self.par = grpo, sampling, par
        self.mtp = mtp_coupling if mtp_num_layers else None
        self.mtp_weight = mtp_loss_scaling_factor
        if mtp_num_layers and drafter is None:  # Qwen3 ships no MTP head: a new one, built like train-drafter's
            torch.manual_seed(seed)
            drafter = MTP(cfg, MTPConfig(mtp_num_layers))
        self.has_drafter = drafter is not None and mtp_num_layers > 0
        init_model_parallel(par, cfg)
        reset_router_tracker()
        self.model = build_model(cfg, par, mtp_num_layers=mtp_num_layers, init=False,
                                 sequence_parallel=sequence_parallel,
                                 batch_p2p_comm=False)
        import_hf(self.model, hf_weights(model, drafter if self.has_drafter else None))
        self.model.train()
        named = list(self.model.named_parameters())
        self.trunk = [(n, p) for n, p in named if not is_mtp(n)]
        self.mtp_layers = [(n, p) for n, p in named if is_mtp(n)]
        self.owned = norm_owned(self.model)
        groups = [dict(params=[p for _, p in self.trunk], lr=grpo.lr, betas=(0.9, 0.99))]
        if self.mtp_layers:
            groups.append(dict(params=[p for _, p in self.mtp_layers], lr=drafter_lr))
        self.opt = torch.optim.AdamW(groups, weight_decay=0.0)
        # With followers, rank 0 announces each call (the RL loop); without, every rank makes the calls itself.
        self.leader = followers and dist.get_rank() == 0 and dist.get_world_size() > 1

    @classmethod
    def from_rl(cls, cfg, model: CausalLM, drafter=None) -> "MegatronPolicy":
        """Built by the loop on rank 0; the other ranks (waiting in `launch.follow_run`) get `cfg` and build theirs
        from the same checkpoints at the same time."""
        m, g = cfg.backend.megatron, cfg.grpo
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_parallelism(model.config, Parallelism.from_section(m), world)
        ensure_process_group()  # one process without torchrun: a one-rank group
        if dist.is_initialized() and dist.get_rank() == 0 and world > 1:
            dist.broadcast_object_list([(BUILD, (cfg,))], src=0)
        return cls(model, g, dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p),
                   Parallelism.from_section(m), drafter=drafter if m.mtp_num_layers else None,
                   mtp_num_layers=m.mtp_num_layers, mtp_coupling=m.mtp_coupling,
                   mtp_loss_scaling_factor=m.mtp_loss_scaling_factor, drafter_lr=cfg.drafter_train.lr,
                   sequence_parallel=m.sequence_parallel, seed=cfg.run.seed, followers=world > 1)

    # -- rank 0 announces, the others follow ------------------------------------------------------------------

    def _announce(self, name: str, *args) -> None:
        if self.leader:
            dist.broadcast_object_list([(name, args)], src=0)

    def follow(self) -> None:
        """Ranks > 0: make every call rank 0 announces, until it stops (`stop`)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args = box[0]
            if name == STOP:
                return
            result = getattr(self, name)(*args)
            if name == "export_weights":
                for _ in result:  # the export is collective: drain it as rank 0 does
                    pass

    def stop(self) -> None:
        """Rank 0: release the followers."""
        self._announce(STOP)

    # -- Policy interface -------------------------------------------------------------------------------------

    def _spec(self, batch: Batch, n_micro: int, fold: bool) -> StepSpec:
        mask = batch.mask
        counts = tuple(float(mask[:, k + 2 :].sum()) for k in range(self.model.config.mtp_num_layers or 0))
        return StepSpec(self.grpo, self.sampling, LossNorm.of(mask[:, 1:]), counts, self.mtp_weight,
                        float(n_micro * ps.get_data_parallel_world_size()), fold)

    def _micros(self, batch: Batch):
        return plan(batch, self.grpo.micro_batch_tokens, ps.get_data_parallel_world_size(),
                    ps.get_data_parallel_rank(), fixed=self.par.pp > 1)

    def _contributes(self) -> bool:
        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T-1] log-prob of each next token (0 outside the completion mask), on every rank."""
        self._announce("logprobs", batch)
        micros = self._micros(batch)
        self.model.eval()
        outs = run_schedule(self.model, micros, self._spec(batch, len(micros), False), None, forward_only=True)
        self.model.train()
        aux_loss_sum(self.model, 1)  # clears Megatron's router-loss tracker
        B, T = batch.mask.shape
        return gather_rows([(o["rows"], o["logprobs"]) for o in outs], (B, T - 1), self._contributes())

    def train_step(self, batch: Batch) -> dict:
        """One policy update (and MTP update) on the batch through Megatron's schedule; metrics as the embedded
        trainer's (`loss` = GRPO loss + MoE load-balancing loss, `grad_norm` of the policy before clipping,
        `drafter_loss` = the MTP layers' soft cross-entropy, mean over depths)."""
        self._announce("train_step", batch)
        fold = batch.old_logprobs is None
        micros = self._micros(batch)
        spec = self._spec(batch, len(micros), fold)
        self.opt.zero_grad(set_to_none=True)
        self.model.train()
        aux_loss_sum(self.model, 1)  # start from an empty router-loss tracker
        outs = run_schedule(self.model, micros, spec, self.mtp, forward_only=False)
        contributes = self._contributes()
        keys = ("policy_loss", "clip_frac", "is_clip_frac", "drafter_loss")
        sums = sum_metrics(outs, contributes, keys)
        total_micro = len(micros) * ps.get_data_parallel_world_size()
        aux = aux_loss_sum(self.model, total_micro)
        metrics = {"loss": sums["policy_loss"] + aux, "clip_frac": sums["clip_frac"]}
        if self.model.config.num_moe_experts:  # the two parts: the GRPO loss and Megatron's router losses
            metrics.update(grpo_loss=sums["policy_loss"], moe_aux_loss=aux)
        if any("is_clip_frac" in o for o in outs) or batch.behaviour_logprobs is not None:
            metrics["is_clip_frac"] = sums["is_clip_frac"]
        if fold:
            B, T = batch.mask.shape
            batch.old_logprobs = gather_rows([(o["rows"], o["logprobs"]) for o in outs], (B, T - 1), contributes)
        if not torch.isfinite(torch.tensor(metrics["loss"])):
            self.opt.zero_grad(set_to_none=True)  # a NaN/inf loss never reaches the weights
            metrics["skipped"] = True
            return metrics
        reduce_grads(self.model)
        metrics["grad_norm"] = clip(self.trunk, self.owned, self.grpo.max_grad_norm)
        if self.mtp:  # collective: stages without MTP layers take part with nothing
            clip(self.mtp_layers, self.owned, 1.0)
            metrics["drafter_loss"] = sums["drafter_loss"]
        self.opt.step()
        metrics["skipped"] = False
        return metrics

    def export_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        """(hf_name, full tensor) of the policy, then the MTP layers as the generator's drafter (`drafter.mtp.*`).
        Collective: the caller must drain the iterator (the loop's refit does)."""
        self._announce("export_weights", bucket_bytes)
        for name, t in export_hf(self.model, bucket_bytes):
            if is_mtp(name):
                if not self.has_drafter:
                    continue
                name = DRAFTER_PREFIX + name
            yield name, t

    # -- checkpoints ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _params_as(self, key: str, create: bool = False):
        """Each parameter's data temporarily replaced by its Adam state `key` (zeros before the first step; kept
        when `create`), so the exporter and importer map the optimizer state exactly as they map the weights
        (names, shards, experts, stages)."""
        params = [p for group in self.opt.param_groups for p in group["params"]]
        saved = [p.data for p in params]
        for p in params:
            value = self.opt.state.get(p, {}).get(key)
            if value is None:
                value = torch.zeros_like(p)
                if create:
                    self.opt.state[p][key] = value
            p.data = value
        try:
            yield
        finally:
            for p, d in zip(params, saved):
                p.data = d

    def state_dict(self) -> dict:
        """Full HF-named weights and Adam moments (layout-independent), the Adam step and the learning rates."""
        self._announce("state_dict")
        state = {"weights": {n: t.cpu().clone() for n, t in export_hf(self.model)}}
        for key in OPT_STATES:
            with self._params_as(key):
                state[key] = {n: t.cpu().clone() for n, t in export_hf(self.model)}
        steps = [float(s["step"]) for s in self.opt.state.values() if "step" in s]
        state["step"] = max(steps, default=0.0)
        state["layout"] = self.par.describe()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Every rank imports its shards of the weights and Adam moments saved at any layout."""
        self._announce("load_state_dict", state)
        import_hf(self.model, state["weights"])
        for key in OPT_STATES:
            with self._params_as(key, create=True):
                import_hf(self.model, state[key])
        for group in self.opt.param_groups:
            for p in group["params"]:
                self.opt.state[p]["step"] = torch.tensor(state["step"])
