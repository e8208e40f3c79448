"""What a colocated trainer releases while the engine on the same devices wakes and generates, and takes back before
its next update.

`offload(policy)`: every optimizer state tensor and every separate fp32 master copy (the optimizer's parameters
that are not the model's) moves to host memory, every gradient is freed (each train step starts from none:
`zero_grad(set_to_none=True)`), and the allocator's cached memory is returned (`torch.cuda.empty_cache` on GPUs;
`malloc_trim` on CPUs, where freed heap pages otherwise stay resident). The model's own weights stay: the refit
reads them and the log-prob pass uses them. `onload(policy)` moves the states and masters back to the devices they
came from, bit for bit. On a CPU the states already live in host memory, so only the gradients and the trimmed
heap are released.

Found on the policy: its optimizers (`opt`, and the `opt` of every drafter trainer it holds, itself or in a part
trained beside it such as an online drafter head) and its model parameters (`model`, `drafter`). A policy whose
optimizer keeps its own buffers (Megatron-Core's distributed optimizer, `mopt`) is refused: its buffers are not reachable this way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field

import torch

from .. import memory

HOST = torch.device("cpu")


@dataclass
class Offloaded:
    """What `offload` moved, to put back: (tensor owner, key, original device) for optimizer states and masters."""

    states: list = field(default_factory=list)
    masters: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def optimizers(policy) -> list:
    """The policy's optimizer (`opt`) and those of the drafter trainers it holds, directly or in a part (an online
    drafter head's), each once."""
    from ..drafters.trainer import DrafterTrainer

    parts = [policy, *vars(policy).values()]
    found = [getattr(policy, "opt", None)] + [t.opt for part in parts for t in getattr(part, "__dict__", {}).values()
                                              if isinstance(t, DrafterTrainer)]
    found = [o for o in found if isinstance(o, torch.optim.Optimizer)]
    return list({id(o): o for o in found}.values())

def _model_params(policy) -> list:
    params = []
    for name in ("model", "drafter"):
        module = getattr(policy, name, None)
        if isinstance(module, torch.nn.Module):
            params += list(module.parameters())
    return params


def device_bytes(policy) -> int:
    """Bytes of optimizer states, separate masters and gradients that live on an accelerator (0 on a CPU run)."""
    total = 0
    for t in _releasable(policy):
        if t.device.type != "cpu":
            total += t.numel() * t.element_size()
    return total


def _releasable(policy):
    model = {id(p) for p in _model_params(policy)}
    for opt in optimizers(policy):
        for state in opt.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))
        for group in opt.param_groups:
            yield from (p for p in group["params"] if id(p) not in model)
    for p in _all_params(policy):
        if p.grad is not None:
            yield p.grad


def _all_params(policy) -> list:
    seen, out = set(), []
    for p in _model_params(policy) + [p for o in optimizers(policy) for g in o.param_groups for p in g["params"]]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _grad_bytes(policy) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in _all_params(policy) if p.grad is not None)


def release_caches() -> None:
    """Return cached allocator memory: CUDA's caching allocator, and glibc's free heap pages on the host."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


@torch.no_grad()
def offload(policy) -> dict:
    """Release the policy's optimizer states, masters and gradients (see the module docstring); returns the
    memory metrics: resident set (and CUDA allocated) before and after, bytes moved and freed."""
    if getattr(policy, "mopt", None) is not None:
        raise NotImplementedError("offload: Megatron-Core's distributed optimizer keeps its own buffers; colocated "
                                  "offload needs backend.megatron.optimizer=torch")
    if getattr(policy, "offloaded", None) is not None:
        return policy.offloaded.metrics
    before = _snapshot()
    record = Offloaded()
    model = {id(p) for p in _model_params(policy)}
    moved = 0
    for opt in optimizers(policy):
        for state in opt.state.values():
            for key, v in state.items():
                if torch.is_tensor(v) and v.device != HOST:
                    record.states.append((state, key, v.device))
                    state[key] = v.to(HOST)
                    moved += v.numel() * v.element_size()
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in model and p.device != HOST:
                    record.masters.append((p, p.device))
                    p.data = p.data.to(HOST)
                    moved += p.numel() * p.element_size()
    freed = _grad_bytes(policy)
    for p in _all_params(policy):
        p.grad = None
    release_caches()
    after = _snapshot()
    record.metrics = {"offload_moved_mb": moved / memory.MB, "offload_freed_grad_mb": freed / memory.MB,
                      **{f"{k}_before_offload": v for k, v in before.items()},
                      **{f"{k}_offloaded": v for k, v in after.items()}}
    policy.offloaded = record
    return record.metrics


@torch.no_grad()
def onload(policy) -> dict:
    """Put back what `offload` moved (nothing when nothing was offloaded); returns the resident set after."""
    record = getattr(policy, "offloaded", None)
    if record is None:
        return {}
    for state, key, device in record.states:
        state[key] = state[key].to(device)
    for p, device in record.masters:
        p.data = p.data.to(device)
    policy.offloaded = None
    return {f"{k}_onloaded": v for k, v in _snapshot().items()}


def _snapshot() -> dict:
    out = {"trainer_rss_mb": (memory.rss_bytes() or 0) / memory.MB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["trainer_cuda_allocated_mb"] = torch.cuda.memory_allocated() / memory.MB
    return out
