"""What the spawned ranks run for `test_at_scale.py`: sharded load from files against the in-memory load,
bf16 against fp32 steps, distributed checkpoints saved at one layout and resumed at another, and an interrupted
save. Each scenario returns plain tensors / floats / lists; the tests compare them in the parent process."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_spec.interfaces import Batch

from .common import hf_tensors, policy_part, save_hf_dir, tiny
from .policy_workers import SAMPLING, batches, grpo, megatron_steps, our_drafter, our_model, with_policy_old

LOAD_LAYOUTS = {"dense": {"tp2": dict(tp=2), "pp2": dict(pp=2)},
                "moe": {"ep2": dict(ep=2, etp=1), "pp2": dict(pp=2), "tp2": dict(tp=2)},
                "tied": {"tp2": dict(tp=2), "pp2": dict(pp=2)}}
SHARD_BYTES = 20_000
"""Small enough that the tiny checkpoints span several safetensors files (index + shards)."""


def write_dirs(root: Path, kind: str, dtype=torch.float32) -> tuple[Path, Path, dict]:
    """The seeded policy and a 2-layer MTP drafter of `kind` as HF directories (the drafter with the drafter
    config `load_drafter` reads), and their tensors."""
    from megatron_spec.drafters.files import save_drafter

    cfg = tiny(kind)
    tensors = {n: t.to(dtype) for n, t in hf_tensors(cfg).items()}
    policy = save_hf_dir(cfg, policy_part(tensors), root / f"{kind}_{dtype}_policy", SHARD_BYTES)
    drafter = root / f"{kind}_{dtype}_drafter"
    if not drafter.exists():
        save_drafter(our_drafter(cfg, 2).to(dtype), drafter, "mtp", cfg)
    return policy, drafter, tensors


def sharded_load(rank: int, world: int, root: str) -> dict:
    """Per kind and layout: this rank's parameters imported from the directories (slices read from the files)
    and from the same tensors in memory (full tensors cut into shards), fp32 and bf16 files."""
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import Parallelism, init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model
    from megatron_spec.drafters.files import load_drafter

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind, layouts in LOAD_LAYOUTS.items():
            if rank == 0:
                write_dirs(Path(root), kind, dtype)
            torch.distributed.barrier()
            policy_dir, drafter_dir, _ = write_dirs(Path(root), kind, dtype)
            cfg = tiny(kind)
            drafter = load_drafter(drafter_dir, cfg, dtype=dtype)
            memory = {**policy_part({n: t for n, t in hf_tensors(cfg).items()}),
                      **{n: t for n, t in drafter.state_dict().items()}}
            memory = {n: t.to(dtype) for n, t in memory.items()}
            for name, sizes in layouts.items():
                par = Parallelism(**sizes)
                init_model_parallel(par, cfg)
                got = []
                for source in ([policy_dir, drafter_dir], memory):
                    model = build_model(cfg, par, mtp_num_layers=2, init=False)
                    import_hf(model, source)
                    got.append({n: p.detach().clone() for n, p in model.named_parameters()})
                out[str(dtype), kind, name] = got
    return out


def bf16_vs_fp32(rank: int, world: int, steps: int = 3) -> dict:
    """3 steps of the dense and MoE tiny models at TP1 in fp32 and in bf16 (fp32 masters): metrics, the trainer's
    log-probs before each step, the masters and the bf16 parameters after."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    out = {}
    for kind in ("dense", "moe"):
        cfg = tiny(kind)
        for dtype in ("float32", "bfloat16"):
            policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(), params_dtype=dtype)
            metrics, logprobs = [], []
            for b in batches(cfg, steps):
                lp = policy.logprobs(b)
                logprobs.append(lp)
                metrics.append(policy.train_step(with_policy_old(b, lp)))
            out[kind, dtype] = {
                "metrics": metrics, "logprobs": logprobs,
                "masters": {n: policy.masters[p].detach().clone() for n, p in policy.model.named_parameters()},
                "params": {n: p.detach().clone() for n, p in policy.model.named_parameters()},
            }
    return out


def recompute_runs(rank: int, world: int) -> dict:
    """2 steps of the MoE tiny model at TP1 with each `recompute`: metrics, and how often the first decoder layer
    and its core attention ran forward during the training steps (recomputed parts run twice)."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    out = {}
    cfg = tiny("moe")
    for recompute in ("none", "selective", "full"):
        policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(), recompute=recompute)
        layer = policy.model.decoder.layers[0]
        calls = {"layer": 0, "core_attention": 0}
        counting = [False]

        def hook(name):
            def count(*_):
                calls[name] += counting[0]
            return count

        layer.register_forward_hook(hook("layer"))
        layer.self_attention.core_attention.register_forward_hook(hook("core_attention"))
        metrics = []
        for b in batches(cfg, 2):
            b = with_policy_old(b, policy.logprobs(b))
            counting[0] = True
            metrics.append(policy.train_step(b))
            counting[0] = False
        out[recompute] = {"metrics": metrics, "calls": dict(calls)}
    return out


def dist_resume(rank: int, world: int, root: str) -> dict:
    """MoE + detached MTP: 4 steps at EP2, against 2 steps at EP2, a distributed checkpoint, and 2 more steps at
    PP2 from it; dense: 4 steps at PP2 against 2 at PP2 + 2 at TP2 (Megatron's padded vocabulary differs); MoE +
    MTP in bf16 with fp32 masters, resumed at the same layout. Also which files each save wrote and their sizes."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    out = {}
    cases = (("moe", "moe", dict(ep=2, etp=1), dict(pp=2), 1, "float32"),
             ("dense", "dense", dict(pp=2), dict(tp=2), 0, "float32"),
             ("moe_bf16", "moe", dict(ep=2, etp=1), dict(ep=2, etp=1), 1, "bfloat16"))
    for name, kind, first_par, second_par, mtp, dtype in cases:
        cfg = tiny(kind)

        def make(par, cfg=cfg, mtp=mtp, dtype=dtype):
            return MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(**par),
                                  drafter=our_drafter(cfg) if mtp else None, mtp_num_layers=mtp, params_dtype=dtype)

        out[name, "straight"] = megatron_steps(make(first_par), kind, 4)
        first = make(first_par)
        megatron_steps(first, kind, 2)
        ckpt = Path(root) / f"{name}_ckpt"
        state = first.save_sharded(ckpt)
        out[name, "files"] = {f.name: f.stat().st_size for f in ckpt.iterdir() if f.is_file()}
        resumed = make(second_par)
        resumed.load_state_dict({**state, "sharded_dir": str(ckpt)})
        out[name, "resumed"] = megatron_steps(resumed, kind, 2, start=2)
    return out


def interrupted_save(rank: int, world: int, root: str) -> dict:
    """A run checkpoint saved at step 0 (`rl.checkpoint.save` with the policy), then a save at step 1 that fails
    after every rank wrote its shards but before the directory is renamed into place (an exception injected into
    Megatron-Core's save, as a kill at that moment would leave it). Then what `load_latest` finds, and the
    weights a fresh policy (another layout) loads from it, against the weights at step 0. MoE with one MTP layer;
    the run's `model.policy` is an HF directory of the model, which `export-hf` reads the config from."""
    from megatron.core import dist_checkpointing

    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.rl import checkpoint
    from megatron_spec.rl.config import RLConfig

    cfg = tiny("moe")
    run_dir = Path(root) / "run"
    hf_dir = Path(root) / "policy_hf"
    if rank == 0:
        save_hf_dir(cfg, policy_part(hf_tensors(cfg)), hf_dir)
    policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(ep=2, etp=1), drafter=our_drafter(cfg),
                            mtp_num_layers=1)
    megatron_steps(policy, "moe", 1)
    at_step0 = {n: t.clone() for n, t in policy.export_weights()}
    rl = RLConfig()
    rl.model.policy = str(hf_dir)  # what `export-hf` reads the model's config.json from
    if rank == 0:
        checkpoint.save(run_dir, 0, policy, rl)
    else:
        policy.save_sharded(None)  # the follower's side of the collective save (rank 0 names the directory)
    megatron_steps(policy, "moe", 1, start=1)
    real = dist_checkpointing.save

    def killed(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt("save interrupted")

    dist_checkpointing.save = killed
    try:
        if rank == 0:
            checkpoint.save(run_dir, 1, policy, rl)
        else:
            policy.save_sharded(None)
        failed = False
    except KeyboardInterrupt:
        failed = True
    finally:
        dist_checkpointing.save = real
    torch.distributed.barrier()
    saved = checkpoint.load_latest(run_dir) if rank == 0 else None
    box = [saved and saved["state"]]
    torch.distributed.broadcast_object_list(box, src=0)
    fresh = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(pp=2), drafter=our_drafter(cfg),
                           mtp_num_layers=1)
    fresh.load_state_dict(box[0])
    loaded = {n: t.clone() for n, t in fresh.export_weights()}
    listing = sorted(os.listdir(run_dir / "checkpoints")) if rank == 0 else None
    return {"failed": failed, "step": saved and saved["step"], "listing": listing, "at_step0": at_step0,
            "loaded": loaded, "run_dir": str(run_dir)}


def save_copies(rank: int, world: int, root: str) -> dict:
    """Bytes Megatron-Core's `torch_dist` writer stages as copies (tensors outside every weight, master and Adam
    moment this rank holds) in a save of the MoE tiny model at EP2 after one step: as `save_sharded` hands it the
    state, and with the state's views left as they are. Also the bytes of this rank's state, for scale."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_spec.trainers.megatron import checkpoint as policy_module
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny("moe")
    policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(ep=2, etp=1))
    megatron_steps(policy, "moe", 1)
    held = [p.data for p in policy.masters] + [s[k] for s in policy.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in held]
    staged = []
    real = FileSystemWriterAsync.prepare_write_data

    def counting(self, plan, planner):
        real(self, plan, planner)
        for _, _, (_, tensors) in self.write_buckets:
            for _, t in tensors:
                ptr = t.data_ptr()
                if not any(a <= ptr < b for a, b in spans):
                    staged[-1] += t.numel() * t.element_size()

    FileSystemWriterAsync.prepare_write_data = counting
    out = {"state_bytes": sum(t.numel() * t.element_size() for t in held)}
    try:
        staged.append(0)
        policy.save_sharded(Path(root) / "as_saved")
        out["copied"] = staged[-1]
        keep = policy_module.unviewed
        policy_module.unviewed = lambda sd: None
        try:
            staged.append(0)
            policy.save_sharded(Path(root) / "views_left")
            out["copied_with_views"] = staged[-1]
        finally:
            policy_module.unviewed = keep
    finally:
        FileSystemWriterAsync.prepare_write_data = real
    return out


def varied_batches(cfg, n: int = 2) -> list[Batch]:
    """8 rows of prompt 4 and completions of 1-8 tokens (right-padded to 12), so rows differ in length."""
    from .policy_workers import PROMPT, T

    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(200 + s)
        ids = torch.randint(0, cfg.vocab_size, (8, T), generator=g)
        mask = torch.zeros(8, T, dtype=torch.bool)
        for i, k in enumerate(torch.randperm(8, generator=g).tolist()):
            mask[i, PROMPT : PROMPT + 1 + k] = True
        old = None if s == 0 else 0.3 * torch.randn(8, T - 1, generator=g)
        out.append(Batch(ids, mask, torch.randn(8, generator=g), old))
    return out


def packed_vs_padded(rank: int, world: int) -> dict:
    """The dense tiny model at PP2 and at DP2 (both cut micro-batches in lockstep), 2 steps on rows of varied
    length with a 24-token budget, micro-batches packed by token budget and padded to their own longest row, and
    every row padded to the batch's full length: metrics (with the padded positions) and exported weights."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny("dense")
    out = {}
    for name, par in (("pp2", dict(pp=2)), ("dp2", {})):
        for packed in (True, False):
            policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(**par))
            policy.packed = packed
            metrics, weights = [], []
            for b in varied_batches(cfg):
                metrics.append(policy.train_step(with_policy_old(b, policy.logprobs(b))))
                weights.append({n: t.clone() for n, t in policy.export_weights()})
            out[name, packed] = {"metrics": metrics, "weights": weights}
    return out
