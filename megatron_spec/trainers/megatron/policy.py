"""`MegatronPolicy`: the Policy interface (`logprobs`, `train_step`, `export_weights`, `state_dict` /
`load_state_dict`) on a Megatron-Core `GPTModel` split over TP / PP / EP, with the MTP head as Megatron's own MTP
layers trained in the same backward and optimizer step, or an EAGLE-3 head trained online beside it, detached,
with its own optimizer (`eagle3.py`).

Every rank holds one `MegatronPolicy` and every method is collective: every rank makes the same calls, or rank 0
announces its calls and the other ranks follow them (`protocol.py`).

Loading: given checkpoint directories (the RL loop's case), every rank reads only its own slices of the policy's
and the MTP drafter's safetensors (`importer.import_hf`); no process builds the full model. Given an in-memory
`CausalLM` (tests, tools), its tensors are cut into shards the same way.

Precision: `params_dtype` float32 or bfloat16, the optimizer keeping fp32 masters of bf16 shards. `recompute`
(none | selective | full) is Megatron's activation recompute.

This class builds the model and runs the step; each other job is a file of its own: the optimizer (torch's AdamW
per shard or Megatron-Core's distributed optimizer, fp32 masters: `optimizer.py`), rank 0's announcements
(`protocol.py`), the refit (`refit.py`), checkpoints (`checkpoint.py`), per-rank memory peaks (`rank_memory.py`)
and offloading for a colocated engine (`distributed.offload`).
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
from megatron_spec.drafters.registry import drafter_method, layers_method
from megatron_spec.models.hf_io import read_config
from megatron_spec.rl.grpo import LossNorm
from megatron_spec.interfaces import Batch, no_step_gate
from megatron_spec.refit import DRAFTER_PREFIX

from . import require_megatron
from .checkpoint import ShardedCheckpoints
from .checks import Parallelism, check_parallelism, check_trainer_settings
from .importer import import_hf
from .optimizer import ShardOptimizer
from .parallel import ensure_process_group, init_model_parallel
from .protocol import BUILD, Followers, announce
from .provider import PORTABLE, Speed, build_chunks, speed_overrides
from .rank_memory import rank_memory
from .refit import RefitSource
from .routing import install
from .step import (
    StepSpec, aux_loss_sum, gather_rows, is_mtp, padded_tokens, plan, positions, reset_router_tracker, run_schedule,
    sum_metrics,
)

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_weights(model: CausalLM, drafter) -> dict[str, torch.Tensor]:
    """HF-named tensors of the policy (tied head once) and of an MTP drafter (`mtp.layers.*`)."""
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if drafter is not None:
        tensors.update(drafter.state_dict())
    return {n: t.detach().float() for n, t in tensors.items()}


class MegatronPolicy(Followers, RefitSource, ShardedCheckpoints):
    """The `Policy` (`megatron_spec.interfaces`) on Megatron-Core; its drafter trains in the policy's own schedule,
    so it has no whole-step gate (`supports_step_gate` False)."""

    supports_step_gate = False

    def speculation(self, enabled: bool):
        return no_step_gate(self, enabled)

    @property
    def trains_drafter_online(self) -> bool:
        return self.mtp is not None or self.eagle3 is not None

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
        check_trainer_settings(grpo, par, params_dtype, recompute, optimizer, on_gpus=torch.cuda.is_available())
        drafter_layers = None
        if isinstance(drafter, MTP):
            drafter_layers = drafter.mtp_config.num_layers
        elif drafter is not None:
            meta = read_drafter_config(drafter)
            if meta.get("kind") != layers_method().name:
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
            from ...drafters.registry import beside_method
            from ...layout import online_eagle3_problems

            load_head = beside_method().megatron_hook("load_head")

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
        self.optimizer = ShardOptimizer(self.model, self.chunks, optimizer, self.dtype, grpo.lr, grpo.max_grad_norm,
                                        drafter_lr, clip_mtp=bool(self.mtp))
        self.eagle3 = None
        if eagle3 is not None:
            from ...drafters.registry import beside_method

            online = beside_method().megatron_hook("OnlineHead")
            self.eagle3 = online(self.model, eagle3, grpo, sampling, drafter_cfg)
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
            announce(BUILD, cfg)
        return cls(cfg.model.policy, g, dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p),
                   Parallelism.from_section(m), drafter=mtp_drafter_dir(cfg) if m.mtp_num_layers else None,
                   mtp_num_layers=m.mtp_num_layers, mtp_coupling=m.mtp_coupling,
                   mtp_loss_scaling_factor=m.mtp_loss_scaling_factor, drafter_lr=cfg.drafter_train.lr,
                   sequence_parallel=m.sequence_parallel, seed=cfg.run.seed, followers=world > 1,
                   params_dtype=m.params_dtype, recompute=m.recompute, optimizer=m.optimizer,
                   eagle3=eagle3_drafter_dir(cfg), drafter_cfg=cfg.drafter_train, speed=Speed.from_section(m))

    # The optimizer's state, where `distributed.offload`, the checkpoint mixin and the tests read it.

    @property
    def masters(self) -> dict:
        return self.optimizer.masters

    @property
    def opt(self):
        return self.optimizer.opt

    @property
    def mopt(self):
        return self.optimizer.mopt

    # -- colocated: the optimizer's state off the devices while the engine generates --------------------------

    def offload(self) -> dict:
        """Colocated: optimizer states and fp32 masters to host memory, gradients freed, caches emptied, on every
        rank, while the engine on the same devices generates (`distributed.offload`); rank 0's memory metrics."""
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
        self.optimizer.zero_grad()
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
            self.optimizer.zero_grad()  # a NaN/inf loss never reaches the weights
            metrics["skipped"] = True
            return metrics
        updated, metrics["grad_norm"] = self.optimizer.step()
        if self.mtp:
            metrics["drafter_loss"] = sums["drafter_loss"]
        if not updated:
            metrics["skipped"] = True
            return metrics
        if self.eagle3:  # after the update: the head reads the updated embedding, as the embedded trainer's does
            metrics.update(self.eagle3.step(batch))
        metrics["skipped"] = False
        metrics["memory"] = rank_memory()
        return metrics

    # -- the drafters under the engines' names (the refit's streams, `refit.py`) ------------------------------

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


def _drafter_tensors(drafter: MTP) -> dict[str, torch.Tensor]:
    return {n: t.detach().float() for n, t in drafter.state_dict().items()}


def eagle3_drafter_dir(cfg) -> str | None:
    """The EAGLE-3 head the run names (`model.drafter`, else `spec.model` of a spec whose method the Megatron trainer trains beside
    the policy: EAGLE-3's), or None."""
    if cfg.spec is None or not drafter_method(cfg.spec.method).megatron_beside:
        return None
    return cfg.model.drafter or cfg.spec.model or None


def mtp_drafter_dir(cfg) -> str | None:
    """The MTP drafter checkpoint the run names (`model.drafter`, else `spec.model` of a spec whose method it trains as the policy's MTP
    layers), or None."""
    if cfg.spec is None or not drafter_method(cfg.spec.method).megatron_layers:
        return None
    return cfg.model.drafter or cfg.spec.model or None
