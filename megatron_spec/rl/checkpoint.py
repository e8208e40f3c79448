"""Run checkpoints: policy, optimizer, drafter (+ its optimizer), RNG, step and data position, written atomically;
beside them the online-trained drafter as a checkpoint of its own (`drafter/`), ready for vLLM or another run.

A checkpoint directory is complete before it gets its final name, and `latest` is rewritten after that, so an
interrupted save leaves the previous checkpoint untouched and still pointed to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from ..drafters.registry import drafter_method
from ..models.hf_io import move_into_place, staging_dir
from .config import RLConfig

SHARDED = "policy"
"""Sub-directory of a checkpoint holding a distributed (per-rank sharded) policy checkpoint."""
DRAFTER = "drafter"
"""Sub-directory of a checkpoint holding the online-trained drafter, in the layout of the checkpoint it started from."""

IGNORED_ON_RESUME = {"run.steps", "run.resume", "run.save_every", "run.save_every_s", "run.async_save",
                     "run.async_save_writer",
                     "run.signal_before_s",
                     "run.eval_every", "run.out_dir", "run.report",
                     "grpo.micro_batch_tokens", "grpo.fold_logprob", "grpo.share_prompt", "run.device",
                     *(f"backend.megatron.{k}" for k in ("tp", "pp", "ep", "etp", "first_stage_layers",
                                                          "last_stage_layers", "sequence_parallel", "recompute"))}
"""Fields a resumed run may change (how long, how often, and how or where a step computes the same update: the
Megatron trainer's parallel layout and recompute included, as its checkpoints reshard), all others must match.
`grpo.micro_batch_tokens` ... `run.device` also let a run saved before they existed resume."""


def flatten(cfg) -> dict:
    out = {}

    def walk(prefix, obj):
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(f"{prefix}{f.name}.", getattr(obj, f.name))
        else:
            out[prefix[:-1]] = obj

    walk("", cfg)
    return out


def check_same_config(saved: dict, cfg, run_dir: Path) -> None:
    """Refuse to resume with another config. A field the checkpoint predates counts as its default, which is how
    that run ran (a new field's default keeps the behaviour from before it existed)."""
    now = {k: v for k, v in flatten(cfg).items() if k not in IGNORED_ON_RESUME}
    if "grpo.normalize_std" in saved:  # the boolean that `grpo.std` replaced
        saved = dict(saved)
        saved["grpo.std"] = "population" if saved.pop("grpo.normalize_std") else "none"
    if "backend.is_clip" in saved:  # the truncation that `grpo.rollout_correction.truncate` took over
        saved = dict(saved)
        saved["grpo.rollout_correction.truncate"] = saved.pop("backend.is_clip")
    # Defaults stand in for fields the checkpoint predates, not for the fields of a section it saved as None.
    unset = [k + "." for k, v in saved.items() if v is None]
    defaults = {k: v for k, v in flatten(RLConfig()).items() if not k.startswith(tuple(unset))}
    saved = {k: v for k, v in {**defaults, **saved}.items() if k not in IGNORED_ON_RESUME}
    diff = sorted(k for k in set(now) | set(saved) if json.dumps(now.get(k)) != json.dumps(saved.get(k)))
    if diff:
        k = diff[0]
        raise ValueError(f"resume directory {run_dir} was made with a different config ({len(diff)} field(s) differ, "
                         f"e.g. {k}: saved {saved.get(k)!r}, now {now.get(k)!r}); use another run.out_dir, or "
                         f"run.resume=false to start afresh there (the earlier run is moved to {run_dir}/previous)")


def export_drafter(out: Path, policy_state: dict, cfg) -> None:
    """The drafter the run trains online, taken from the policy's state (`drafter`: the embedded trainer's module;
    `<state_key>.head`: the head the Megatron trainer trains beside the policy, its registry entry's `state_key`), written to `out` in the layout of the checkpoint it
    started from (a public EAGLE-3 head in its speculators or SpecForge layout). The Megatron trainer's MTP layers
    live in its shards: `megatron-spec export-hf` writes those."""
    beside = drafter_method(cfg.spec.method).state_key if cfg.spec else None
    tensors = policy_state.get("drafter") or (policy_state.get(beside) or {}).get("head")
    source = cfg.model.drafter or (cfg.spec.model if cfg.spec else None)
    if tensors is None or not source or not cfg.drafter_train.online:
        return
    from ..drafters.files import export_trained_drafter
    from ..models.hf_io import read_config, smollm2_dir

    policy = cfg.model.policy
    export_trained_drafter(source, tensors, read_config(smollm2_dir() if policy == "smollm2-135m" else policy), out)


def save(run_dir: Path, step: int, state, cfg, loop: dict | None = None) -> Path:
    """`state`: the policy's state dict, or the policy itself; a policy with `save_sharded` (the Megatron trainer)
    then writes its distributed checkpoint into the new directory from every rank, before it gets its name. `loop`:
    the loop's own state beside the policy's, by name (`gate`: the whole-step gate's, `replay`: the groups waiting
    for a later step), where the run has them. In the foreground: complete when it returns."""
    saver = Saver(run_dir, background=False)
    saver.save(step, state, cfg, loop)
    return saver.last


def snapshot(obj):
    """A copy of a state dict's tensors on the host (containers rebuilt, other values shared), so that a thread can
    write it while the next step changes the live ones."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v) for v in obj)
    return obj


WRITER_NICE = 19
"""The background writer thread's niceness (Linux): where the step keeps every core busy, the write takes the idle
time and the step keeps the CPU (a writer at the step's priority slowed the step it overlapped about 2x on 2 cores).
On a node with cores to spare it makes no difference."""


def lower_priority() -> None:
    """Give the calling thread `WRITER_NICE` (Linux schedules threads as tasks; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # no per-thread priorities here
        pass


class Saver:
    """Writes a run's checkpoints one at a time, each into a hidden temporary directory that is renamed to
    `step_NNNNNN` once complete, after which `latest` is rewritten to name it: a save interrupted at any point
    (a failure, a killed process) leaves the previous checkpoint complete and still named by `latest`.

    With `background`, the state is copied to host memory on the caller's thread and written while the next step
    runs: the embedded trainer's state dict (`snapshot`) by a thread, or the Megatron trainer's shards
    (`save_sharded(background=True)`, each rank's by its writer, `run.async_save_writer`; their finalization is
    collective, so the loop's thread does it in `poll` or `wait` and only then renames; under Ray each trainer rank's
    actor writes its own shards, `ShardedTrainerGroup`). A policy that cannot save in the background saves in the
    foreground. Each call returns the step's save metrics: `save_blocking_s` (seconds on the loop's thread) and,
    when a background save completed, `save_background_s` (its write, on rank 0)."""

    def __init__(self, run_dir: Path, background: bool):
        self.root = Path(run_dir) / "checkpoints"
        self.background = background
        self.last: Path | None = None
        self._thread: threading.Thread | None = None
        self._pending: dict | None = None

    def save(self, step: int, state, cfg, loop: dict | None = None, background: bool | None = None) -> dict:
        """Start (or, in the foreground, make) the checkpoint of `step`, after finalizing the one in flight."""
        t0 = time.perf_counter()
        out = self.wait()
        background = self.background if background is None else background
        sharded = not isinstance(state, dict) and hasattr(state, "save_sharded")
        background = background and (not sharded or hasattr(state, "finish_save"))
        tmp = staging_dir(self.root / f"step_{step:06d}")
        try:
            if sharded:
                policy_state = (state.save_sharded(tmp / SHARDED, background=True, writer=cfg.run.async_save_writer)
                                if background
                                else state.save_sharded(tmp / SHARDED))
            else:
                policy_state = state if isinstance(state, dict) else state.state_dict()
                if background:
                    policy_state = snapshot(policy_state)
            payload = {"step": step, "state": policy_state, "rng": torch.get_rng_state(), "config": flatten(cfg),
                       "gate": None, **snapshot(loop or {})}
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        pending = {"tmp": tmp, "step": step, "policy": state if sharded and background else None, "error": None,
                   "seconds": 0.0}
        if background:
            # The embedded trainer's thread finalizes on its own; a sharded save waits for the loop's `poll`.
            self._thread = threading.Thread(target=self._write, args=(pending, payload, cfg, not sharded),
                                            name="checkpoint-writer")
            self._pending = pending
            self._thread.start()
        else:
            self._write(pending, payload, cfg, True)
            self._raise(pending)
        return {**out, "save_blocking_s": time.perf_counter() - t0}

    def _write(self, pending: dict, payload: dict, cfg, finalize: bool) -> None:
        t0 = time.perf_counter()
        if threading.current_thread() is self._thread:
            lower_priority()
        try:
            torch.save(payload, pending["tmp"] / "state.pt")
            export_drafter(pending["tmp"] / DRAFTER, payload["state"], cfg)
            if finalize:
                self._finalize(pending)
        except BaseException as err:  # noqa: BLE001  (raised on the loop's thread by `_raise`)
            pending["error"] = err
        pending["seconds"] = time.perf_counter() - t0

    def _finalize(self, pending: dict) -> None:
        self.last = move_into_place(pending["tmp"], self.root / f"step_{pending['step']:06d}")
        tmp = self.root / "latest.tmp"
        tmp.write_text(self.last.name)
        tmp.replace(self.root / "latest")  # atomic rename: `latest` names a complete checkpoint at every instant

    def _raise(self, pending: dict) -> None:
        if pending["error"] is not None:
            shutil.rmtree(pending["tmp"], ignore_errors=True)
            raise RuntimeError(f"checkpoint of step {pending['step']} not saved: {pending['error']}") \
                from pending["error"]

    def poll(self) -> dict:
        """Finalize a background save whose writing has finished (on this rank: a sharded save's finalization then
        waits for the other ranks' writes); {} while it is still writing or when none is in flight."""
        if self._pending is None:
            return {}
        policy = self._pending["policy"]
        if self._thread.is_alive() or (policy is not None and not policy.save_done()):
            return {}
        return self.wait()

    def wait(self) -> dict:
        """Finalize the background save in flight, waiting for its writes (every rank's, if sharded)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}
        self._thread.join()
        self._raise(pending)
        seconds = pending["seconds"]
        if pending["policy"] is not None:
            try:  # a rank's failed or killed write fails this on every rank: the directory is never named
                seconds += pending["policy"].finish_save() or 0.0
            except BaseException:
                shutil.rmtree(pending["tmp"], ignore_errors=True)
                raise
            self._finalize(pending)
        return {"save_background_s": seconds}


def clear_interrupted(run_dir: Path) -> None:
    """Remove what saves interrupted by a killed process left: their hidden temporary directories."""
    root = Path(run_dir) / "checkpoints"
    for p in root.glob(".step_*") if root.is_dir() else ():
        shutil.rmtree(p, ignore_errors=True)


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """Move what an earlier run left in `run_dir` (metrics, checkpoints, events, report: everything but earlier
    set-asides) into `run_dir/previous/<n>`, so that a run starting from step 0 there writes into an empty directory
    and loses nothing. Appending to the earlier run's `metrics.jsonl` would make its later steps look like the new
    run's, and its checkpoints would be resumed from by the next `run.resume=true`. Returns where they went."""
    entries = sorted(p for p in run_dir.iterdir() if p.name != "previous") if run_dir.is_dir() else []
    if not entries:
        return None
    previous = run_dir / "previous"
    previous.mkdir(exist_ok=True)
    numbers = [p.name.split(".")[0] for p in previous.iterdir()]  # "3" and an interrupted "3.tmp" both take 3
    taken = [int(n) for n in numbers if n.isdigit()]
    dest = previous / str(max(taken, default=0) + 1)
    # Filled under a temporary name first: an interrupted move leaves its entries in `.tmp`, never under a
    # number that looks like a complete earlier run.
    tmp = previous / f"{dest.name}.tmp"
    tmp.mkdir()
    for p in entries:
        p.rename(tmp / p.name)
    tmp.rename(dest)
    return dest


def load_latest(run_dir: Path) -> dict | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    return load_dir(run_dir / "checkpoints" / pointer.read_text().strip())


def load_dir(ckpt_dir: Path) -> dict:
    """One checkpoint directory's payload, a distributed checkpoint beside it named by its full path."""
    # On the host whatever device saved it: `load_state_dict` then copies each tensor to where the run computes
    # (an optimizer's state to its parameter's device), so a run saved on a GPU resumes on a CPU and vice versa.
    payload = torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=False)
    state = payload.get("state")
    if isinstance(state, dict) and "sharded_dir" in state:  # a distributed checkpoint beside state.pt
        state["sharded_dir"] = str(ckpt_dir / state["sharded_dir"])
    return payload
