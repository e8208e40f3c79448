"""A CPU-only check that every tensor the engine, verifier, sampler and trainer make is created on the model's device.

Why a taint check: on a CPU machine the model's device and the host are the same device, so a tensor made without
`device=` (a `torch.tensor(...)` of Python ints, a `torch.zeros(...)` buffer) computes fine here and fails only on a
GPU ("Expected all tensors to be on the same device"), or silently copies every step (a CPU index into a CUDA
tensor is legal, and a sync). Running the model on torch's `meta` device does not help (it cannot compute, so the
engine's data-dependent control flow cannot run), and `torch.set_default_device` would move the very tensors that
should be caught. So `DeviceGuard` labels tensors instead of moving them, with a TorchFunctionMode that sees every
torch call:

- host: made by a factory (`torch.tensor`, `zeros`, `arange`, `rand`, ...) without a device, or by `.cpu()`;
- device: made by a factory given a device, or by `.to(device)` / `.to(tensor)` / `.cuda()` (how a model, and
  with it its parameters, gets to the run's device: `from_pretrained(..., device=)` ends with `.to(device=)`);
- every other op's outputs are device if any input is, else host if any input is; unlabelled tensors (made
  before the guard, or by C++ outside torch's dispatch, e.g. a safetensors load) are neutral.

An op that combines a host tensor of one or more dimensions with a device tensor is a violation (0-dim host
tensors are exempt: CUDA ops accept CPU scalars, which is how torch's own optimizers keep `step`). `copy_` is the
one legal crossing, and a host copy is spelled `.cpu()`. On this CPU `.to(device)` returns its input; the guard
returns an alias instead, so that the caller's tensor keeps its host label as it would on a GPU. That is stricter than CUDA itself, which also accepts CPU
index tensors: those cost a host-to-device copy and a sync per use, which is exactly what the engine must avoid.
A parameter inherits its data's label (`nn.Parameter` wraps its tensor in a new Python object torch's dispatch
does not see), so a module built without `.to(device)` keeps host parameters and is caught at its first forward.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

HOST, DEVICE = "host", "device"
LABEL = "_device_guard_label"
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye}
TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
TO_HOST = {torch.Tensor.cpu}


def tensors(values) -> list[torch.Tensor]:
    """The tensors among `values` and inside their lists / tuples (an op's arguments or outputs; `torch.cat` takes a
    list, `split` returns a tuple); a hand-written walk: torch's pytree made the guarded suite three times slower."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def label(t: torch.Tensor) -> str | None:
    return getattr(t, LABEL, None)


def names_device(args, kwargs) -> bool:
    """Whether a `.to(...)` call names a device (a string, torch.device or tensor), not only a dtype."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])


class DeviceGuard(TorchFunctionMode):
    """`with DeviceGuard() as guard: ...` labels tensors as described above; `guard.violations` lists each mixed op
    with the package's frames that made it (the first one also raises at once, in the code that made it)."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []

    def __enter__(self):
        self.original_new = torch.nn.Parameter.__dict__["__new__"]
        new = torch.nn.Parameter.__new__

        def parameter_new(cls, data=None, requires_grad=True):
            param = new(cls, data, requires_grad)
            if data is not None and label(data) is not None:
                setattr(param, LABEL, label(data))
            return param

        torch.nn.Parameter.__new__ = staticmethod(parameter_new)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self.original_new
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = tensors(out if isinstance(out, (list, tuple)) else (out,))
        if not outputs and func is not torch.Tensor.__setitem__:  # .tolist(), .item(), .shape: nothing to label
            return out
        inputs = tensors((*args, *kwargs.values()))
        if func in FACTORIES and not (func is torch.as_tensor and inputs):
            new = DEVICE if kwargs.get("device") is not None else HOST
        elif func in TO_HOST:
            new = HOST
        elif func in TO_DEVICE and names_device(args, kwargs):
            new = DEVICE
            if out is args[0] and not isinstance(out, torch.nn.Parameter):
                # Already there (this CPU is "the device"): a new alias, so the caller's tensor stays host as it
                # would on a GPU. A parameter is relabelled in place: `Module.to` keeps the parameter object.
                out = outputs[0] = out.view_as(out)
        elif func is torch.Tensor.copy_:
            new = label(args[0])
        else:
            labels = {label(t) for t in inputs}
            if DEVICE in labels and any(label(t) == HOST and t.dim() > 0 for t in inputs):
                self.violate(func)
            new = DEVICE if DEVICE in labels else HOST if HOST in labels else None
        if new is not None:
            for t in outputs:
                setattr(t, LABEL, new)
        return out

    def violate(self, func) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "megatron_spec" in f.filename]
        where = "; ".join(f"{f.filename.split('megatron_spec/')[-1]}:{f.lineno} {f.line}" for f in frames[-3:])
        self.violations.append(f"{getattr(func, '__name__', func)} mixes a host tensor with a device tensor at {where}")
        raise AssertionError(self.violations[-1])
