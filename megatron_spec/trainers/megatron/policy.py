"""`MegatronPolicy`: the Policy interface (`logprobs`, `train_step`, `export_weights`, `state_dict` /
`load_state_dict`) on a Megatron-Core `GPTModel` split over TP / PP / EP, with the MTP head as Megatron's own MTP
layers trained in the same backward and optimizer step, or an EAGLE-3 head trained online beside it, detached,
with its own optimizer (`eagle3.py`).

Every rank holds one `MegatronPolicy` and every method is collective. Either every rank makes the same calls
(SPMD, `followers=False`: the tests), or, for the RL loop, which runs on rank 0 only and never sees
torch.distributed, rank 0's calls are first announced to the other ranks (`_announce`: method name and arguments,
one broadcast), which wait in `follow()` and make the same call (`from_rl` sets `followers`; `launch.py` starts
the ranks). A single process (world size 1) is the same code without announcements.

Loading: given checkpoint directories (the RL loop's case), every rank reads only its own slices of the policy's
and the MTP drafter's safetensors (`importer.import_hf`); no process builds the full model. Given an in-memory
`CausalLM` (tests, tools), its tensors are cut into shards the same way.

Precision: `params_dtype` float32 or bfloat16. With bfloat16 the optimizer works on fp32 master copies of this
rank's shards (gradients converted to fp32 before clipping, the update copied back rounded to bf16), so the
weights and Adam moments keep fp32 precision and only the forward / backward run in bf16. `recompute` (none |
selective | full) is Megatron's activation recompute.

Optimizer: torch's AdamW on each rank's shards with the embedded trainer's settings (policy: `grpo.lr`, betas
(0.9, 0.99); MTP layers: `drafter_train.lr`, torch's default betas, as the embedded drafter), after the
gradients are reduced (`step.reduce_grads`) and clipped, policy and MTP layers separately (`grpo.max_grad_norm`,
1.0), so a detached MTP head leaves the policy update exactly as without it. Megatron-Core's distributed
optimizer (`optimizer="megatron"`: Megatron's DDP with fp32 gradient buffers, fp32 masters and Adam states sharded
over data parallel) is CUDA only, refused elsewhere before anything is built. It keeps the same contract: the MTP
layers are their own parameter groups in the one optimizer (`drafter_train.lr`, torch's default betas) and are
clipped apart from the policy (`_megatron_step`), so a detached MTP head leaves the policy update as without it.

Checkpoints (`save_sharded` / `load_sharded`, in the foreground or the background): `checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.models import CausalLM
from megatron_spec.drafters.files import read_drafter_config
from megatron_spec.drafters.trainer import MAX_GRAD_NORM
from megatron_spec.models.hf_io import read_config
from megatron_spec.rl.grpo import LossNorm
from megatron_spec.trainers.embedded import Batch
from megatron_spec.rl.refit import DRAFTER_PREFIX

from . import require_megatron
from .checkpoint import ShardedCheckpoints
from .checks import Parallelism, check_parallelism
from .importer import import_hf
from .parallel import ensure_process_group, init_model_parallel
from .provider import PORTABLE, Speed, build_chunks, speed_overrides
from .routing import install
from .step import device as _device
from .step import (
    StepSpec, aux_loss_sum, clip, gather_rows, is_mtp, named_chunks, norm_owned, padded_tokens, plan, positions,
    reduce_grads, reset_router_tracker, run_schedule, sum_metrics,
)

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402

STOP = "__stop__"
BUILD = "__build__"
MTP_MAX_GRAD_NORM = MAX_GRAD_NORM
"""The MTP layers' gradient clip: the online drafter trainer's (`drafters.trainer`)."""
MTP_BETAS = (0.9, 0.999)
"""The MTP layers' Adam betas: torch's default, as the online drafter trainer's."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_weights(model: CausalLM, drafter) -> dict[str, torch.Tensor]:
    """HF-named tensors of the policy (tied head once) and of an MTP drafter (`mtp.layers.*`)."""
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if drafter is not None:
        tensors.update(drafter.state_dict())
    return {n: t.detach().float() for n, t in tensors.items()}


class MegatronPolicy(ShardedCheckpoints):
    def __init__(self, model: CausalLM | str | os.PathLike, grpo, sampling: dict, par: Parallelism, *,
                 drafter: MTP | str | os.PathLike | None = None, mtp_num_layers: int = 0,
                 mtp_coupling: str = "detached", mtp_loss_scaling_factor: float = 0.1, drafter_lr: float = 3e-4,
                 sequence_parallel: bool = False, seed: int = 0, followers: bool = False,
                 params_dtype: str = "float32", recompute: str = "none", optimizer: str = "torch",
                 eagle3=None, drafter_cfg=None, speed: Speed | None = None):
        """`model`: an HF checkpoint directory (each rank reads its own slices) or a loaded `CausalLM`; `drafter`:
        an MTP drafter directory or module (None with `mtp_num_layers`: a new head, as train-drafter makes);
        `eagle3`: an EAGLE-3 head (directory or module) trained online beside the policy (`eagle3.py`) with the
        `drafter_train` section `drafter_cfg`; `speed`: MoE dispatcher, fusions and recompute details
        (`provider.Speed`, its `recompute` replaced by `recompute`; None: `provider.PORTABLE`)."""
        from_files = not isinstance(model, CausalLM)
        cfg = read_config(model) if from_files else model.config
        if grpo.kl_coef > 0:
            raise NotImplementedError("the Megatron trainer has no reference model yet: use grpo.kl_coef=0")
        if par.cp > 1:
            raise NotImplementedError("context parallelism (cp > 1) is not wired into the Megatron trainer yet")
        if params_dtype not in DTYPES:
            raise ValueError(f"params_dtype must be one of {', '.join(DTYPES)}, got {params_dtype!r}")
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
        if optimizer == "megatron" and not torch.cuda.is_available():
            raise NotImplementedError("backend.megatron.optimizer=megatron (Megatron-Core's distributed optimizer) "
                                      "needs CUDA; on the CPU use optimizer=torch (AdamW per shard, fp32 masters)")
        if optimizer not in ("torch", "megatron"):
            raise ValueError(f"optimizer must be torch or megatron, got {optimizer!r}")
        drafter_layers = None
        if isinstance(drafter, MTP):
            drafter_layers = drafter.mtp_config.num_layers
        elif drafter is not None:
            meta = read_drafter_config(drafter)
            if meta.get("kind") != "mtp":
                raise ValueError(f"backend.megatron.mtp_num_layers={mtp_num_layers} trains an MTP head, but the "
                                 f"drafter in {drafter} is a {meta.get('kind')!r}")
            drafter_layers = meta.get("config", {}).get("num_layers", MTPConfig().num_layers)
        if mtp_num_layers and drafter is not None and not isinstance(drafter, (MTP, str, os.PathLike)):
            raise ValueError(f"backend.megatron.mtp_num_layers={mtp_num_layers} trains an MTP head, but the drafter "
                             f"is a {type(drafter).__name__}")
        if mtp_num_layers and drafter_layers is not None and drafter_layers != mtp_num_layers:
            raise ValueError(f"the MTP drafter has {drafter_layers} layer(s), "
                             f"backend.megatron.mtp_num_layers={mtp_num_layers}")
        if par.vp > 1 and (mtp_num_layers or optimizer == "megatron"):
            raise ValueError(f"backend.megatron.virtual_pipeline={par.vp} runs without MTP layers and "
                             "optimizer=megatron: set virtual_pipeline=1 or turn those off")
        if grpo.routing_replay:
            from ...layout import routing_replay_problems

            if not cfg.is_moe:
                raise ValueError("grpo.routing_replay replays the experts of an MoE policy; this one is dense")
            if problems := routing_replay_problems(recompute, sequence_parallel, par.vp):
                raise ValueError("; ".join(problems))
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_parallelism(cfg, par, world, sequence_parallel=sequence_parallel,  # before any rank allocates
                          on_gpus=torch.cuda.is_available())
        speed_kw = speed_overrides(replace(speed or PORTABLE, recompute=recompute), moe=cfg.is_moe)
        if eagle3 is not None:  # a head that does not fit, or beside MTP layers, fails before anything is built
            from ...layout import online_eagle3_problems
            from ...drafters.eagle3.megatron import load_head

            if problems := online_eagle3_problems(mtp_num_layers, par.vp):
                raise ValueError("; ".join(problems))
            if drafter_cfg is None:
                raise ValueError("an online EAGLE-3 head needs its drafter_train section (drafter_cfg)")
            eagle3 = load_head(eagle3, cfg)
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed initialised on every rank "
                               "(backends.megatron.launch starts it; tests use parallel.spawn)")
        self.grpo, self.sampling, self.par = grpo, sampling, par
        self.mtp = mtp_coupling if mtp_num_layers else None
        self.mtp_weight = mtp_loss_scaling_factor
        self.dtype = DTYPES[params_dtype]
        if mtp_num_layers and drafter is None:  # Qwen3 ships no MTP head: a new one, built like train-drafter's
            torch.manual_seed(seed)
            drafter = MTP(cfg, MTPConfig(mtp_num_layers))  # one or a few layers, not the policy
        self.has_drafter = drafter is not None and mtp_num_layers > 0
        init_model_parallel(par, cfg)
        reset_router_tracker()
        # This rank's model chunks: its stage, or with virtual pipeline stages its vp chunks (`provider.build_chunks`).
        self.chunks = build_chunks(cfg, par, mtp_num_layers=mtp_num_layers, init=False, dtype=self.dtype,
                                   sequence_parallel=sequence_parallel, batch_p2p_comm=False, **speed_kw)
        # `model`: the one chunk, or all of them as one module (train / eval modes, dtype, offloading).
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        self.config = self.chunks[0].config
        if self.dtype != torch.float32:  # modules Megatron takes from torch (the RMSNorm without Apex / TE) too
            self.model.to(self.dtype)
        self.routing = install(self.model, [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
                               ) if grpo.routing_replay else {}
        if from_files:  # every rank reads its own slices from the files; a new MTP head comes from memory
            sources = [model]
            if self.has_drafter:
                sources.append(drafter if not isinstance(drafter, MTP) else _drafter_tensors(drafter))
            import_hf(self.chunks, sources if len(sources) > 1 else model)
        else:
            mtp_head = drafter if self.has_drafter and isinstance(drafter, MTP) else None
            import_hf(self.chunks, hf_weights(model, mtp_head))
        self.model.train()
        named = named_chunks(self.chunks)
        # fp32 master copies of low-precision shards: the optimizer updates these, the model gets them rounded.
        self.masters = {p: (p if p.dtype == torch.float32 or optimizer != "torch"
                            else torch.nn.Parameter(p.detach().float().clone())) for _, p in named}
        self.trunk = [(n, p) for n, p in named if not is_mtp(n)]
        self.mtp_layers = [(n, p) for n, p in named if is_mtp(n)]
        self.owned = norm_owned(self.chunks)
        groups = [dict(params=[self.masters[p] for _, p in self.trunk], lr=grpo.lr, betas=(0.9, 0.99))]
        if self.mtp_layers:
            groups.append(dict(params=[self.masters[p] for _, p in self.mtp_layers], lr=drafter_lr))
        self.opt = torch.optim.AdamW(groups, weight_decay=0.0) if optimizer == "torch" else None
        self.optimizer = optimizer
        self.ddp = self.mopt = None
        if optimizer == "megatron":
            self._megatron_optimizer(grpo, drafter_lr)
        self.eagle3 = None
        if eagle3 is not None:
            from ...drafters.eagle3.megatron import Eagle3Online

            self.eagle3 = Eagle3Online(self.model, eagle3, grpo, sampling, drafter_cfg)
        self.packed = True  # micro-batches by token budget, padded to their own longest row (`step.plan`)
        self.one_schedule = True  # one schedule call per pass over micro-batches of any shapes (`step.run_schedule`)
        # With followers, rank 0 announces each call (the RL loop); without, every rank makes the calls itself.
        self.leader = followers and dist.get_rank() == 0 and dist.get_world_size() > 1

    @classmethod
    def from_rl(cls, cfg, model: CausalLM | None = None, drafter=None) -> "MegatronPolicy":
        """Built by the loop on rank 0; the other ranks (waiting in `launch.follow_run`) get `cfg` and build theirs
        at the same time. Every rank reads its own slices of the policy (`model.policy`) and of an MTP drafter
        (`model.drafter` / `spec.model`) from the checkpoint files; `model` and `drafter` are not used for that
        (the loop passes None: it never loads the full policy for a Megatron trainer)."""
        m, g = cfg.backend.megatron, cfg.grpo
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_parallelism(read_config(cfg.model.policy), Parallelism.from_section(m), world,
                          sequence_parallel=m.sequence_parallel, on_gpus=torch.cuda.is_available())
        ensure_process_group()  # one process without torchrun: a one-rank group
        if dist.is_initialized() and dist.get_rank() == 0 and world > 1:
            dist.broadcast_object_list([(BUILD, (cfg,))], src=0)
        return cls(cfg.model.policy, g, dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p),
                   Parallelism.from_section(m), drafter=mtp_drafter_dir(cfg) if m.mtp_num_layers else None,
                   mtp_num_layers=m.mtp_num_layers, mtp_coupling=m.mtp_coupling,
                   mtp_loss_scaling_factor=m.mtp_loss_scaling_factor, drafter_lr=cfg.drafter_train.lr,
                   sequence_parallel=m.sequence_parallel, seed=cfg.run.seed, followers=world > 1,
                   params_dtype=m.params_dtype, recompute=m.recompute, optimizer=m.optimizer,
                   eagle3=eagle3_drafter_dir(cfg), drafter_cfg=cfg.drafter_train, speed=Speed.from_section(m))

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

    def offload(self) -> dict:
        """Colocated: optimizer states and fp32 masters to host memory, gradients freed, caches emptied, on every
        rank, while the engine on the same devices generates (`backends.offload`); rank 0's memory metrics."""
        from ...distributed.offload import offload

        self._announce("offload")
        return offload(self)

    def onload(self) -> dict:
        """Every rank takes back what `offload` moved (before the next train step)."""
        from ...distributed.offload import onload

        self._announce("onload")
        return onload(self)

    # -- Policy interface -------------------------------------------------------------------------------------

    def _spec(self, batch: Batch, n_micro: int, fold: bool) -> StepSpec:
        mask = batch.mask
        counts = tuple(float(mask[:, k + 2 :].sum()) for k in range(self.config.mtp_num_layers or 0))
        return StepSpec(self.grpo, self.sampling, LossNorm.of(mask[:, 1:]), counts, self.mtp_weight,
                        float(n_micro * ps.get_data_parallel_world_size()), fold, self.routing)

    def _micros(self, batch: Batch):
        return plan(batch, self.grpo.micro_batch_tokens, ps.get_data_parallel_world_size(),
                    ps.get_data_parallel_rank(), fixed=self.par.pp > 1, packed=self.packed,
                    min_micros=self.par.pp if self.par.vp > 1 else 1)

    def _contributes(self) -> bool:
        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T-1] log-prob of each next token (0 outside the completion mask), on every rank."""
        self._announce("logprobs", batch)
        micros = self._micros(batch)
        self.model.eval()
        outs, _ = run_schedule(self.chunks, micros, self._spec(batch, len(micros), False), None, forward_only=True,
                               one_call=self.one_schedule)
        self.model.train()
        aux_loss_sum(self.config, 1)  # clears Megatron's router-loss tracker
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
        self._zero_grad()
        self.model.train()
        aux_loss_sum(self.config, 1)  # start from an empty router-loss tracker
        with self.eagle3.capture(micros, batch.mask) if self.eagle3 else contextlib.nullcontext():
            outs, calls = run_schedule(self.chunks, micros, spec, self.mtp, forward_only=False,
                                       one_call=self.one_schedule)
        contributes = self._contributes()
        keys = ("policy_loss", "clip_frac", "is_clip_frac", "drafter_loss", "pad_tokens", "positions")
        sums = sum_metrics([*outs, {"pad_tokens": padded_tokens(micros), "positions": positions(micros)}],
                           contributes, keys)
        total_micro = len(micros) * ps.get_data_parallel_world_size()
        aux = aux_loss_sum(self.config, total_micro)
        metrics = {"loss": sums["policy_loss"] + aux, "clip_frac": sums["clip_frac"], "pad_tokens": sums["pad_tokens"],
                   "train_schedule_calls": calls, "train_pad_fraction": sums["pad_tokens"] / max(sums["positions"], 1)}
        if self.config.num_moe_experts:  # the two parts: the GRPO loss and Megatron's router losses
            metrics.update(grpo_loss=sums["policy_loss"], moe_aux_loss=aux)
        if any("is_clip_frac" in o for o in outs) or batch.behaviour_logprobs is not None:
            metrics["is_clip_frac"] = sums["is_clip_frac"]
        if fold:
            B, T = batch.mask.shape
            batch.old_logprobs = gather_rows([(o["rows"], o["logprobs"]) for o in outs], (B, T - 1), contributes)
        if not torch.isfinite(torch.tensor(metrics["loss"])):
            self._zero_grad()  # a NaN/inf loss never reaches the weights
            metrics["skipped"] = True
            return metrics
        if self.mopt is not None:  # Megatron-Core: reduce(-scatter) in fp32, clip, step the sharded fp32 masters
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            if self.mtp:  # every rank, with or without MTP layers on its stage
                updated, grad_norm = self._megatron_step()
            else:
                updated, grad_norm, _ = self.mopt.step()
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
            if self.mtp:
                metrics["drafter_loss"] = sums["drafter_loss"]
            if not updated:
                metrics["skipped"] = True
                return metrics
        else:
            for chunk in self.chunks:
                reduce_grads(chunk)
            self._grads_to_masters()
            metrics["grad_norm"] = clip(self._master_named(self.trunk), self.owned, self.grpo.max_grad_norm)
            if self.mtp:  # collective: stages without MTP layers take part with nothing
                clip(self._master_named(self.mtp_layers), self.owned, MTP_MAX_GRAD_NORM)
                metrics["drafter_loss"] = sums["drafter_loss"]
            self.opt.step()
            self._masters_to_params()
        if self.eagle3:  # after the update: the head reads the updated embedding, as the embedded trainer's does
            metrics.update(self.eagle3.step(batch))
        metrics["skipped"] = False
        metrics["memory"] = self._rank_memory()
        return metrics

    def _rank_memory(self) -> dict:
        """Every rank's peak RSS (and CUDA peaks) in MB, as lists by global rank. Collective. Ranks > 0 then start
        new peaks; rank 0's belongs to the loop's process, whose step ends later (`rl.memory.step_memory`)."""
        from megatron_spec.rl import memory

        world, rank = dist.get_world_size(), dist.get_rank()
        cuda = memory.cuda_peaks(reset=rank != 0)
        keys = ["trainer_peak_rss_mb", *(f"trainer_{k}" for k in sorted(cuda))]
        table = torch.zeros(len(keys), world, dtype=torch.float64, device=_device())
        table[0, rank] = (memory.peak_rss_bytes() or 0) / memory.MB
        for i, k in enumerate(sorted(cuda), 1):
            table[i, rank] = cuda[k]
        if world > 1:
            dist.all_reduce(table)
        if rank != 0:
            memory.reset_peak()
        return {k: row.tolist() for k, row in zip(keys, table.cpu())}

    # -- optimizers -------------------------------------------------------------------------------------------

    def _megatron_optimizer(self, grpo, drafter_lr: float) -> None:
        """Megatron-Core's distributed optimizer (CUDA only; checked by the caller): the model in Megatron's DDP
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
        self.ddp = DistributedDataParallel(config=self.model.config, ddp_config=ddp_config, module=self.model)
        opt_config = OptimizerConfig(optimizer="adam", lr=grpo.lr, min_lr=grpo.lr, weight_decay=0.0,
                                     adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8,
                                     bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                                     use_distributed_optimizer=True, clip_grad=grpo.max_grad_norm)
        overrides = None
        if self.mtp:  # every rank: Megatron aligns the parameter groups across ranks
            overrides = get_standard_config_overrides(opt_config)  # what Megatron applies when given none
            mtp_ids = {id(p) for _, p in self.mtp_layers}
            mtp_key = ParamKey(predicate=ParamPredicate(name="mtp_layers", fn=lambda p: id(p) in mtp_ids))
            overrides[mtp_key] = dict(lr=drafter_lr, max_lr=drafter_lr, min_lr=drafter_lr, betas=MTP_BETAS,
                                      is_decoupled_lr=True)
        self.mopt = get_megatron_optimizer(opt_config, [self.ddp], config_overrides=overrides)
        self.masters = {p: p for p in self.masters}  # the optimizer keeps its own (sharded) fp32 copies

    def _megatron_subs(self) -> list:
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
        for mtp, max_norm in ((False, self.grpo.max_grad_norm), (True, MTP_MAX_GRAD_NORM)):
            parts, squares = [], 0.0
            for sub in self._megatron_subs():
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

    def _megatron_adam_step(self) -> float:
        """Adam's step count in Megatron-Core's optimizer (TE / Apex keep it per group, torch per parameter)."""
        steps = []
        for sub in self._megatron_subs():
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            steps += [float(g["step"]) for g in inner.param_groups if g["params"] and "step" in g]
            steps += [float(s["step"]) for s in inner.state.values() if "step" in s]
        return max(steps, default=0.0)

    def _zero_grad(self) -> None:
        if self.mopt is not None:
            self.ddp.zero_grad_buffer()
            self.mopt.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=True)

    def _torch_optimizer_only(self, what: str) -> None:
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
    def _masters_to_params(self) -> None:
        for p, m in self.masters.items():
            if m is not p:
                p.copy_(m)

    def export_weights(self, bucket_bytes: int | None = None, dtype: str | None = None):
        """(hf_name, full tensor) of the policy, then the MTP layers as the generator's drafter (`drafter.mtp.*`),
        gathered one refit bucket at a time (`bucket_bytes`, default the loop's refit bucket), floating shards cast
        to `dtype` (the engines' dtype name; None: as trained) before they are gathered (`refit_stream`).
        Collective: the caller must drain the iterator (the loop's refit does)."""
        from megatron_spec.rl.loop import REFIT_BUCKET_BYTES

        from ...distributed.weight_group import dtype_of
        from .refit_stream import refit_buckets

        bucket_bytes = bucket_bytes or REFIT_BUCKET_BYTES
        self._announce("export_weights", bucket_bytes, dtype)
        stream = refit_buckets(self.chunks, bucket_bytes, dtype_of(dtype) if dtype else None)
        yield from self._for_engines((item for bucket in stream for item in bucket), eagle3=True)

    def _for_engines(self, items, eagle3: bool, shared: bool = False):
        """The engines' names: MTP layers as the drafter (`drafter.mtp.*`, dropped without one), then, when
        `eagle3`, the EAGLE-3 head (broadcast from the rank that trains it as the stream reaches it, a collective
        every rank's stream makes; `shared`: broadcast already, before any stream started)."""
        for name, t in items:
            if is_mtp(name):
                if not self.has_drafter:
                    continue
                name = DRAFTER_PREFIX + name
            yield name, t
        if eagle3 and self.eagle3:
            yield from self.eagle3.export(share=not shared)

    def join_weights(self, host: str, port: int, world: int, timeout_s: float, backend: str, senders: int) -> None:
        """Join the weight-update group at `host:port` (rank 0 hosts it) as one sender per pipeline stage, the
        stage's first rank (`refit_stream.join_stage_sender`); the other ranks only gather. Collective."""
        from .refit_stream import join_stage_sender

        self._announce("join_weights", host, port, world, timeout_s, backend, senders)
        self.weight_group = join_stage_sender(host, port, world, timeout_s, backend, senders)

    def send_weights(self, bucket_bytes: int, dtype: str | None) -> dict:
        """One refit into the joined weight-update group: each pipeline stage gathers only its own buckets and its
        sender sends them (stage 0's also the EAGLE-3 head); the senders' bytes and waits and every rank's
        received bytes (`refit_stream.send_stages`). Collective."""
        from ...distributed.weight_group import dtype_of
        from .refit_stream import send_stages, stage_buckets

        self._announce("send_weights", bucket_bytes, dtype)
        cast, received = dtype_of(dtype) if dtype else None, [0]
        stream = stage_buckets(self.chunks, bucket_bytes, cast, received)
        group = getattr(self, "weight_group", None)
        if group is None and dist.get_rank() == 0:
            raise RuntimeError("send_weights before join_weights: the weight-update group is not formed")
        if self.eagle3:  # shared on every rank first: a stage's sender blocked on it mid-stream would hold its
            self.eagle3.share()  # receivers, and they the other stages' senders
        named = self._for_engines((item for bucket in stream for item in bucket), eagle3=group is not None and
                                  group.rank == 0, shared=True)
        return send_stages(group, named, received, bucket_bytes, cast)


def _group_params(sub, mtp: bool) -> list:
    """The main parameters of one Megatron sub-optimizer's MTP groups (`mtp`) or policy groups (the MTP groups are
    the ones marked `is_decoupled_lr`, `_megatron_optimizer`); none for a rank without parameters in it."""
    inner = None if getattr(sub, "is_stub_optimizer", False) else getattr(sub, "optimizer", None)
    groups = inner.param_groups if inner is not None else []
    return [p for g in groups if bool(g.get("is_decoupled_lr", False)) == mtp for p in g["params"]]


def _drafter_tensors(drafter: MTP) -> dict[str, torch.Tensor]:
    return {n: t.detach().float() for n, t in drafter.state_dict().items()}


def eagle3_drafter_dir(cfg) -> str | None:
    """The EAGLE-3 head the run names (`model.drafter`, else `spec.model` of an `eagle3` spec), or None."""
    if cfg.spec is None or cfg.spec.method != "eagle3":
        return None
    return cfg.model.drafter or cfg.spec.model or None


def mtp_drafter_dir(cfg) -> str | None:
    """The MTP drafter checkpoint the run names (`model.drafter`, else `spec.model` of an `mtp` spec), or None."""
    if cfg.spec is None or cfg.spec.method != "mtp":
        return None
    return cfg.model.drafter or cfg.spec.model or None
