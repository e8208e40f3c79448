"""The drafter registry: one entry per speculative method, and the only place outside a method's folder that knows
what each method is.

An entry says whether the method needs weights and how they load, how its proposer is built, how its drafter is
trained online (or that it is not), how it runs in vLLM (method, options, export of its tensors and config), how it
sits in a checkpoint, and what one draft step costs in the simulator. Config validation, the engine, the RL loop,
`train-drafter`, the benchmarks, the vLLM backend, the Megatron trainer, the simulator and the launch checks all
read it.

Each method is one folder of this package whose `method.py` calls `register(DrafterMethod(...))`; the registry
imports every such `method.py` the first time an entry is asked for, so adding a drafter is adding a folder. Those
modules import models, proposers and losses inside their callables: discovery stays cheap (config validation needs
only the names). Their adapters (vLLM export, simulator cost, the Megatron head) sit above the generators, the
simulator and the trainers they plug into, so entries name them by module (`adapter`, `DrafterMethod.megatron`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Callable

DEFAULT_METHOD = "mtp"
"""The drafter an RL config gets when it names none (`RLConfig.spec`), and the simulator's main-job estimate."""

DEFAULT_SIM_DRAFTER = "eagle3"
"""The drafter the simulator assumes when told none: the EAGLE-3 head of the reference system it is calibrated
against (`sim.reference`)."""


@dataclass(frozen=True)
class DrafterMethod:
    name: str
    """The `SpecConfig.method` value."""
    proposer: Callable
    """(spec, target, drafter) -> Proposer; `drafter` is the loaded module, or None when `needs_weights` is False.
    Raises ValueError on a drafter that does not fit the target, before any generation."""
    needs_weights: bool = False
    """True: a drafter checkpoint (`SpecConfig.model` / `model.drafter`) is required, loaded with `load`."""
    load: Callable | None = None
    """(path, target, device) -> drafter module; set exactly when `needs_weights`."""
    new: Callable | None = None
    """(target, draft_preset, d2t) -> a fresh drafter module, for `megatron-spec train-drafter`; None: not trainable
    offline."""
    save: Callable | None = None
    """(drafter, out_dir, target) -> the directory written, in the layout `load` reads; set exactly when `new` is."""
    online_loss: Callable | None = None
    """(target, drafter, input_ids, out, logits, mask, drafts) -> list[DepthPair] (`drafter_loss.depth_pairs`):
    what the RL step trains the drafter on; None: the method has nothing to train."""
    draft_vocab: bool = False
    """Whether the drafter can have a reduced draft vocabulary (`train-drafter --draft-vocab`)."""
    vllm_method: str | None = None
    """vLLM's `speculative_config["method"]` for this drafter; None: no vLLM counterpart (embedded generator only)."""
    vllm_options: Callable | None = None
    """spec -> extra `speculative_config` entries vLLM takes for this method."""
    vllm_needs: tuple[str, str] | None = None
    """(module, extra): a package vLLM imports to draft this way, and the megatron-spec extra that installs it."""
    module: Callable | None = None
    """() -> the drafter module's class, imported when asked; set exactly when `needs_weights`. `build_proposer`
    refuses a drafter of another class, and `method_of` finds a module's method by it."""
    saved_config: Callable | None = None
    """() -> (config dataclass, attribute of the module holding it) of a head saved in our layout (`files.py`,
    whose `drafter_config.json` names the method as its `kind`); None: not saved in our layout."""
    vllm_export: Callable | None = None
    """(drafter module, out_dir) -> the directory vLLM loads as this drafter (`generators.vllm.export`)."""
    vllm_export_files: Callable | None = None
    """(src, target config, out_dir, dtype) -> `DrafterExport`: the same directory written from the checkpoint files
    `src` without building the module."""
    vllm_form: Callable | None = None
    """drafter module -> the JSON-able arguments of `vllm_convert` for its streamed refit tensors; None: they load
    as they are."""
    vllm_convert: Callable | None = None
    """(tensors by name, *form) -> the tensors in vLLM's form; what the vLLM worker applies to a refit."""
    megatron_layers: bool = False
    """The Megatron trainer trains it as the policy's own MTP layers (Megatron-Core's `mtp_num_layers`), jointly
    with the policy, in its forward and its checkpoint shards."""
    state_key: str | None = None
    """Set when the Megatron trainer trains it beside the policy with its own trainer (`<folder>/megatron.py`):
    the key of that trainer's state in the policy's state and checkpoint."""
    megatron: str | None = None
    """The module of its Megatron adapter (`<folder>/megatron.py`: `load_head`, `OnlineHead`) for a drafter the
    Megatron trainer trains beside the policy; imported by name (`megatron_hook`), since it sits above the trainer."""
    sim_shape: Callable | None = None
    """(target config, draft_model preset, layers, draft_vocab, kv_dtype_bytes) -> the simulator's `CostShape` of
    one draft forward; None: drafting uses no accelerator."""
    sim_name: str | None = None
    """The simulator's name for this drafter (`--drafter`), when it differs from the method's."""
    listing: int = 100
    """Place in `method_names()` (ascending, then by name): the order of menus and benchmark rows."""

    @property
    def sim_label(self) -> str:
        """The simulator's name for it: `sim_name`, else the method's."""
        return self.sim_name or self.name

    @property
    def standalone(self) -> bool:
        """Whether its weights are a whole model of their own (an HF checkpoint or a preset, named on its own: the
        benchmarks' `--draft-model`), not a head made for one target."""
        return self.needs_weights and self.saved_config is None

    @property
    def megatron_beside(self) -> bool:
        """Whether the Megatron trainer trains it beside the policy (own trainer and optimizer, unrolled drafts)."""
        return self.state_key is not None

    def megatron_hook(self, name: str):
        """`name` from the Megatron adapter module (`megatron`), imported now."""
        if self.megatron is None:
            raise ValueError(f"drafter method {self.name!r} has no Megatron adapter")
        return getattr(importlib.import_module(self.megatron), name)

    def __post_init__(self) -> None:
        if self.needs_weights != (self.load is not None):
            raise ValueError(f"drafter method {self.name!r}: `load` must be given exactly when needs_weights is True")
        if (self.new is None) != (self.save is None):
            raise ValueError(f"drafter method {self.name!r}: `new` and `save` go together")
        if self.online_loss is not None and not self.needs_weights:
            raise ValueError(f"drafter method {self.name!r}: an online loss needs a drafter with weights")
        if self.needs_weights != (self.module is not None):
            raise ValueError(f"drafter method {self.name!r}: `module` must be given exactly when needs_weights is True")
        if (self.vllm_form is None) != (self.vllm_convert is None):
            raise ValueError(f"drafter method {self.name!r}: `vllm_form` and `vllm_convert` go together")


_METHODS: dict[str, DrafterMethod] = {}
_discovered = False


def discover(package: str = __package__) -> None:
    """Import `method.py` of every folder of `package` (each registers its method). This package's own folders
    are imported once, the first time an entry is asked for."""
    global _discovered
    if package == __package__:
        if _discovered:
            return
        _discovered = True
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"{package}.{info.name}.method") is not None:
            importlib.import_module(f"{package}.{info.name}.method")


def _methods() -> dict[str, DrafterMethod]:
    discover()
    return _METHODS


def register(method: DrafterMethod) -> DrafterMethod:
    """Add `method`; a name already registered is an error (unregister it first)."""
    discover()  # the folders first, so that a name of theirs is refused whichever comes first
    if method.name in _METHODS:
        raise ValueError(f"drafter method {method.name!r} is already registered")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    _METHODS.pop(name)


def drafter_method(name: str) -> DrafterMethod:
    """The entry for `name`; an unknown name raises ValueError listing the known ones."""
    try:
        return _methods()[name]
    except KeyError:
        raise ValueError(f"unknown speculative method {name!r}: known are {', '.join(method_names())}") from None


def method_of(drafter) -> DrafterMethod:
    """The entry whose drafter module class `drafter` is an instance of (the most derived one when several fit)."""
    fits = [m for m in _methods().values() if m.module is not None and isinstance(drafter, m.module())]
    if not fits:
        raise ValueError(f"no drafter method has a {type(drafter).__name__} module")
    return max(fits, key=lambda m: len(m.module().__mro__))


def method_names(*, weights: bool | None = None, trainable: bool = False, vllm: bool = False) -> tuple[str, ...]:
    """Registered names in `listing` order; `weights` True/False keeps those that do / do not need weights,
    `trainable` those `train-drafter` can make, `vllm` those with a vLLM counterpart."""
    ordered = sorted(_methods().values(), key=lambda m: (m.listing, m.name))
    return tuple(m.name for m in ordered
                 if (weights is None or m.needs_weights == weights) and (not trainable or m.new is not None)
                 and (not vllm or m.vllm_method is not None))


def vllm_problem(name: str) -> str | None:
    """Why `name` cannot draft in vLLM on this machine (no vLLM counterpart, or the package its vLLM method imports
    is not installed); None when it can. Read without importing anything, so a config check asks it."""
    method = drafter_method(name)
    if method.vllm_method is None:
        return (f"speculative method {name!r} has no vLLM counterpart: use one of "
                f"{', '.join(method_names(vllm=True))} with backend.generator=vllm, or the embedded generator")
    if method.vllm_needs is not None and importlib.util.find_spec(method.vllm_needs[0]) is None:
        module, extra = method.vllm_needs
        return (f"speculative method {name!r} drafts in vLLM through its {method.vllm_method!r} method, which needs "
                f"{module}: `pip install 'megatron-spec[{extra}]'`")
    return None


def needs_weights(name: str) -> bool:
    return drafter_method(name).needs_weights


def build_proposer(spec, target, drafter=None):
    """The proposer for `spec.method`, with `drafter` (a module) or the checkpoint at `spec.model`.

    Every mismatch (vocabulary, target architecture, wrong module for the method) is raised here, before any
    generation starts.
    """
    method = drafter_method(spec.method)
    if method.needs_weights and drafter is None:
        if spec.model is None:
            raise ValueError(f"speculative method {spec.method!r} needs a drafter: pass drafter= or set SpecConfig.model")
        drafter = method.load(spec.model, target, target.device)
    if method.needs_weights and not isinstance(drafter, method.module()):
        raise ValueError(f"method {spec.method!r} needs a {method.module().__name__} drafter, "
                         f"got {type(drafter).__name__}")
    return method.proposer(spec, target, drafter if method.needs_weights else None)


def adapter(module: str, name: str) -> Callable:
    """`name` of `module`, imported when first called: a drafter's adapters (its vLLM export, its simulator cost) sit
    above the generators and the simulator they plug into, which reach them only through the registry, so the
    drafters' own package imports none of them; and an entry's other callables stay unimported until used, so
    discovery is cheap."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def beside_method() -> DrafterMethod:
    """The method the Megatron trainer trains beside the policy with a trainer of its own (`megatron`)."""
    return next(m for m in _methods().values() if m.megatron is not None)


def layers_method() -> DrafterMethod:
    """The method the Megatron trainer trains as the policy's own MTP layers (`megatron_layers`)."""
    return next(m for m in _methods().values() if m.megatron_layers)


def saved_kinds() -> dict[str, DrafterMethod]:
    """The methods whose heads are saved in our layout (`files.py`), by the `kind` their files name."""
    return {m.name: m for m in _methods().values() if m.saved_config is not None}


def sim_names() -> tuple[str, ...]:
    """The simulator's drafter names (`--drafter`), in `method_names()` order."""
    return tuple(drafter_method(n).sim_label for n in method_names())


def sim_drafter(name: str) -> DrafterMethod:
    """The method the simulator calls `name`; an unknown name raises ValueError listing the known ones."""
    for n in method_names():
        if drafter_method(n).sim_label == name:
            return drafter_method(n)
    raise ValueError(f"unknown drafter {name!r}: known are {', '.join(sim_names())}")
