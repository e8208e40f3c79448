"""Run checkpoints: policy, optimizer, drafter (+ its optimizer), RNG, step and data position, written atomically;
beside them the online-trained drafter as a checkpoint of its own (`drafter/`), ready for vLLM or another run.

A checkpoint directory is complete before it gets its final name, and `latest` is rewritten after that, so an
interrupted save leaves the previous checkpoint untouched and still pointed to.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..models.hf_io import write_atomically
from .config import RLConfig

SHARDED = "policy"
"""Sub-directory of a checkpoint holding a distributed (per-rank sharded) policy checkpoint."""
DRAFTER = "drafter"
"""Sub-directory of a checkpoint holding the online-trained drafter, in the layout of the checkpoint it started from."""

IGNORED_ON_RESUME = {"run.steps", "run.resume", "run.save_every", "run.save_every_s", "run.signal_before_s",
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
    `eagle3.head`: the Megatron trainer's EAGLE-3 head), written to `out` in the layout of the checkpoint it
    started from (a public EAGLE-3 head in its speculators or SpecForge layout). The Megatron trainer's MTP layers
    live in its shards: `megatron-spec export-hf` writes those."""
    tensors = policy_state.get("drafter") or (policy_state.get("eagle3") or {}).get("head")
    source = cfg.model.drafter or (cfg.spec.model if cfg.spec else None)
    if tensors is None or not source or not cfg.drafter_train.online:
        return
    from ..models.drafters import export_trained_drafter
    from ..models.hf_io import read_config, smollm2_dir

    policy = cfg.model.policy
    export_trained_drafter(source, tensors, read_config(smollm2_dir() if policy == "smollm2-135m" else policy), out)


def save(run_dir: Path, step: int, state, cfg, gate: dict | None = None) -> Path:
    """`state`: the policy's state dict, or the policy itself; a policy with `save_sharded` (the Megatron trainer)
    then writes its distributed checkpoint into the new directory from every rank, before it gets its name. `gate`:
    the whole-step gate's state, where the run has one."""
    ckpt_root = run_dir / "checkpoints"

    def write(tmp: Path) -> None:
        policy_state = state
        if not isinstance(state, dict):
            policy_state = state.save_sharded(tmp / SHARDED) if hasattr(state, "save_sharded") else state.state_dict()
        payload = {"step": step, "state": policy_state, "rng": torch.get_rng_state(), "config": flatten(cfg),
                   "gate": gate}
        torch.save(payload, tmp / "state.pt")
        export_drafter(tmp / DRAFTER, policy_state, cfg)

    out = write_atomically(ckpt_root / f"step_{step:06d}", write)
    tmp = ckpt_root / "latest.tmp"
    tmp.write_text(out.name)
    tmp.replace(ckpt_root / "latest")  # atomic rename: `latest` names a complete checkpoint at every instant
    return out


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
    # On the host whatever device saved it: `load_state_dict` then copies each tensor to where the run computes
    # (an optimizer's state to its parameter's device), so a run saved on a GPU resumes on a CPU and vice versa.
    ckpt_dir = run_dir / "checkpoints" / pointer.read_text().strip()
    payload = torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=False)
    state = payload.get("state")
    if isinstance(state, dict) and "sharded_dir" in state:  # a distributed checkpoint beside state.pt
        state["sharded_dir"] = str(ckpt_dir / state["sharded_dir"])
    return payload
