"""The drafter registry: one entry per speculative method, and the only place that knows what each method is.

An entry says whether the method needs weights and how they load, how its proposer is built, how its drafter is
trained online (or that it is not), which vLLM `speculative_config` method runs it there, and which cost profile
the simulator gives it. Config validation, the engine, the RL loop, `train-drafter`, the benchmarks, the vLLM
backend, the simulator's comparison and the launch checks all read it, so adding a drafter is one `register` call.

Imports of models, proposers and losses happen inside the entries' callables: importing the registry stays cheap
(config validation needs only the names), and those modules never import the registry back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


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
    sim_profile: str = "ngram"
    """The simulator's drafter cost profile (`sim.shapes.DRAFTER_KINDS`): what one draft step costs on a GPU."""

    def __post_init__(self) -> None:
        if self.needs_weights != (self.load is not None):
            raise ValueError(f"drafter method {self.name!r}: `load` must be given exactly when needs_weights is True")
        if (self.new is None) != (self.save is None):
            raise ValueError(f"drafter method {self.name!r}: `new` and `save` go together")
        if self.online_loss is not None and not self.needs_weights:
            raise ValueError(f"drafter method {self.name!r}: an online loss needs a drafter with weights")


_METHODS: dict[str, DrafterMethod] = {}


def register(method: DrafterMethod) -> DrafterMethod:
    """Add `method`; a name already registered is an error (unregister it first)."""
    if method.name in _METHODS:
        raise ValueError(f"drafter method {method.name!r} is already registered")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    _METHODS.pop(name)


def drafter_method(name: str) -> DrafterMethod:
    """The entry for `name`; an unknown name raises ValueError listing the known ones."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown speculative method {name!r}: known are {', '.join(_METHODS)}") from None


def method_names(*, weights: bool | None = None, trainable: bool = False, vllm: bool = False) -> tuple[str, ...]:
    """Registered names in registration order; `weights` True/False keeps those that do / do not need weights,
    `trainable` those `train-drafter` can make, `vllm` those with a vLLM counterpart."""
    return tuple(m.name for m in _METHODS.values()
                 if (weights is None or m.needs_weights == weights) and (not trainable or m.new is not None)
                 and (not vllm or m.vllm_method is not None))


def vllm_problem(name: str) -> str | None:
    """Why `name` cannot draft in vLLM on this machine (no vLLM counterpart, or the package its vLLM method imports
    is not installed); None when it can. Read without importing anything, so a config check asks it."""
    import importlib.util

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
    return method.proposer(spec, target, drafter if method.needs_weights else None)


# --- the built-in drafters -----------------------------------------------------------------------------------------

def _ngram(spec, target, drafter):
    from .ngram.proposer import NgramProposer

    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _history(spec, target, drafter):
    from .ngram.proposer import HistoryProposer

    return HistoryProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.history_docs_per_prompt)


def _load_causal_lm(path, target, device):
    from ..models import from_pretrained

    return from_pretrained(path, dtype=target.dtype, device=device)


def _load_head(path, target, device):
    from .files import load_drafter

    return load_drafter(path, target.config, dtype=target.dtype, device=device)


def _check_type(spec, drafter, cls) -> None:
    if not isinstance(drafter, cls):
        raise ValueError(f"method {spec.method!r} needs a {cls.__name__} drafter, got {type(drafter).__name__}")


def _draft_model(spec, target, drafter):
    from .files import check_draft_model
    from ..models.decoder import CausalLM
    from .draft_model.proposer import DraftModelProposer

    _check_type(spec, drafter, CausalLM)
    check_draft_model(drafter.config, target.config)
    return DraftModelProposer(drafter.to(target.device), spec.draft_sampling)


def _hidden_state(module: str, cls_name: str):
    """The proposer factory of a head that drafts from the target's hidden states (MTP, EAGLE-3); the head's class is
    `cls_name` in `module` (relative to this package), imported when a proposer is built."""

    def build(spec, target, drafter):
        import importlib

        from .hidden import HiddenStateProposer

        _check_type(spec, drafter, getattr(importlib.import_module(module, __package__), cls_name))
        if drafter.target_config.vocab_size != target.config.vocab_size:
            raise ValueError(f"drafter vocabulary ({drafter.target_config.vocab_size}) differs from the target's "
                             f"({target.config.vocab_size})")
        if drafter.target_config.hidden_size != target.config.hidden_size:
            raise ValueError(f"{spec.method} drafter was built for hidden size {drafter.target_config.hidden_size}, "
                             f"the target has {target.config.hidden_size}")
        return HiddenStateProposer(target, drafter.to(target.device, target.dtype), spec.draft_sampling)

    return build


def _new_mtp(target, draft_preset, d2t):
    from .mtp.model import MTP, MTPConfig

    return MTP(target.config, MTPConfig(1))


def _new_eagle3(target, draft_preset, d2t):
    from .eagle3.model import Eagle3Head

    return Eagle3Head.from_target(target, d2t=d2t)


def _new_draft_model(target, draft_preset, d2t):
    from ..models import CausalLM, preset

    if not draft_preset:
        raise ValueError("draft_model training needs --draft-preset (e.g. tiny-draft) or --init DIR")
    return CausalLM(preset(draft_preset))


def _save_causal_lm(drafter, out_dir, target):
    from ..models import save_pretrained

    return save_pretrained(drafter, out_dir)


def _save_head(kind: str):
    def save(drafter, out_dir, target):
        from .files import save_drafter

        return save_drafter(drafter, out_dir, kind, target.config)

    return save


def _mtp_loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import mtp_pairs

    return mtp_pairs(target, drafter, input_ids, out, logits, mask, drafts)


def _eagle3_loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import eagle3_pairs

    return eagle3_pairs(target, drafter, input_ids, out, logits, mask, drafts)


def _draft_model_loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import draft_model_pairs

    return draft_model_pairs(drafter, input_ids, logits, mask)


def _prompt_lookup(spec) -> dict:
    return {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}


def _suffix(spec) -> dict:
    """vLLM's suffix decoding drafts from a tree of the request's prompt and of earlier requests' completions (the
    rollouts of one prompt repeat each other, across a step's group and across steps): its trees deep enough for
    the longest n-gram matched plus the drafts."""
    return {"suffix_decoding_max_tree_depth": spec.prompt_lookup_max + spec.num_speculative_tokens}


register(DrafterMethod("draft_model", _draft_model, needs_weights=True, load=_load_causal_lm, new=_new_draft_model,
                       save=_save_causal_lm, online_loss=_draft_model_loss, vllm_method="draft_model",
                       sim_profile="model"))
register(DrafterMethod("mtp", _hidden_state(".mtp.model", "MTP"), needs_weights=True, load=_load_head, new=_new_mtp,
                       save=_save_head("mtp"), online_loss=_mtp_loss, vllm_method="mtp", sim_profile="mtp"))
register(DrafterMethod("eagle3", _hidden_state(".eagle3.model", "Eagle3Head"), needs_weights=True, load=_load_head, new=_new_eagle3,
                       save=_save_head("eagle3"), online_loss=_eagle3_loss, draft_vocab=True, vllm_method="eagle3",
                       sim_profile="eagle3"))
register(DrafterMethod("ngram", _ngram, vllm_method="ngram", vllm_options=_prompt_lookup, sim_profile="ngram"))
register(DrafterMethod("history", _history, vllm_method="suffix", vllm_options=_suffix,
                       vllm_needs=("arctic_inference", "suffix"), sim_profile="ngram"))
