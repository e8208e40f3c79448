"""What the spawned ranks run for `test_async_save.py`: a background save (`rl.checkpoint.Saver` on rank 0, the
collective `save_sharded` / `finish_save` on the others) written while the next step trains, against a foreground
save of the same state; then the next step from each."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import torch.distributed as dist

from .common import tiny
from .policy_workers import SAMPLING, grpo, megatron_steps, our_drafter, our_model


def background_vs_foreground(rank: int, world: int, root: str) -> dict:
    """MoE with one MTP layer at EP2: a step, then the same state saved in the foreground (step_000000) and in the
    background (step_000001, its writer held until the next step has updated the weights and moments, finalized
    after it); fresh policies at another layout (PP2) load each and take the same next step."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.rl import checkpoint
    from megatron_spec.rl.config import RLConfig

    cfg = tiny("moe")

    def make(par):
        return MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(**par), drafter=our_drafter(cfg),
                              mtp_num_layers=1)

    from megatron_spec.trainers.megatron.checkpoint import BackgroundWrite

    go, write = threading.Event(), BackgroundWrite._write

    def held(self, args):  # the writer starts only once the next step has changed what it writes
        assert go.wait(300)
        write(self, args)

    BackgroundWrite._write = held
    rl = RLConfig()
    rl.run.async_save_writer = "thread"  # the writer process has its own case (`process_writer`)
    run_dir = Path(root) / "run"
    policy = make(dict(ep=2, etp=1))
    megatron_steps(policy, "moe", 1)
    saver = checkpoint.Saver(run_dir, background=True) if rank == 0 else None
    metrics = {}
    for step, background in ((0, False), (1, True)):
        if rank == 0:
            metrics[step] = saver.save(step, policy, rl, background=background)
        else:
            policy.save_sharded(None, background=background, writer="thread")
    overlapped = megatron_steps(policy, "moe", 1, start=1)  # changes every weight and moment the write reads
    go.set()
    BackgroundWrite._write = write
    if rank == 0:
        metrics["finished"] = saver.wait()
    else:
        policy.finish_save()
    out = {"metrics": metrics, "overlapped": overlapped["weights"][-1]}
    for step in (0, 1):
        box = [checkpoint.load_dir(run_dir / "checkpoints" / f"step_{step:06d}")["state"] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        fresh = make(dict(pp=2))
        fresh.load_state_dict(box[0])
        out[step] = {"loaded": {n: t.clone() for n, t in fresh.export_weights()},
                     "next": megatron_steps(fresh, "moe", 1, start=1)}
    out["failed"] = failed_write(rank, fresh, saver, rl, run_dir)  # the last built policy holds the groups
    out["process"] = process_writer(rank, fresh, saver, run_dir)
    return out


def process_writer(rank: int, policy, saver, run_dir: Path) -> dict:
    """The same state saved in the foreground (step 3) and by the writer process (step 4, held until the next step
    has changed the weights, finalized after it); on rank 0 whether every tensor of the two checkpoints is equal,
    and the writer's pid."""
    import dataclasses
    import os

    from megatron_spec.rl.config import RLConfig
    from megatron_spec.trainers.megatron import writer
    from megatron_spec.trainers.megatron.checkpoint import BackgroundWrite

    from .common import sharded_tensors

    rl = RLConfig()
    rl = dataclasses.replace(rl, run=dataclasses.replace(rl.run, async_save_writer="process"))
    go, write = threading.Event(), BackgroundWrite._write

    def held(self, args):
        assert go.wait(300)
        write(self, args)

    for step, background in ((3, False), (4, True)):
        BackgroundWrite._write = held if background else write
        if rank == 0:
            saver.save(step, policy, rl, background=background)
        else:
            policy.save_sharded(None, background=background, writer="process")
    megatron_steps(policy, "moe", 1, start=2)
    go.set()
    BackgroundWrite._write = write
    saver.wait() if rank == 0 else policy.finish_save()
    dist.barrier()
    pid = writer._writer.process.pid
    if rank != 0:
        return {"pid": pid, "me": os.getpid()}
    a, b = (sharded_tensors(run_dir / "checkpoints" / f"step_{s:06d}") for s in (3, 4))
    return {"pid": pid, "me": os.getpid(), "keys": len(a),
            "equal": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)}


def failed_write(rank: int, policy, saver, rl, run_dir: Path) -> dict:
    """A background save (step 2) whose writer fails on rank 1 only: what each rank's finalization raised, and on
    rank 0 the checkpoint files before and after, the directories left and what `latest` names."""
    from megatron_spec.trainers.megatron.checkpoint import BackgroundWrite

    def files():
        root = run_dir / "checkpoints"
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    before = files() if rank == 0 else None
    write = BackgroundWrite._write

    def broken(self, args):
        if rank == 1:
            self.error = OSError("injected: disk full")
            return
        write(self, args)

    BackgroundWrite._write = broken
    try:
        if rank == 0:
            saver.save(2, policy, rl, background=True)
        else:
            policy.save_sharded(None, background=True, writer="thread")
    finally:
        BackgroundWrite._write = write
    try:
        saver.wait() if rank == 0 else policy.finish_save()
        raised = None
    except Exception as err:  # noqa: BLE001
        raised = f"{type(err).__name__}: {err}"
    dist.barrier()  # the group still works after the failed save
    out = {"raised": raised}
    if rank == 0:
        after = files()
        out.update(unchanged=all(after.get(k) == v for k, v in before.items()),
                   new=sorted(set(after) - set(before)),
                   dirs=sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
                   latest=(run_dir / "checkpoints" / "latest").read_text())
    return out
