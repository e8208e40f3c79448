"""The figures of the results page's section "At full size, audited": the memory audit of both flagships as
shipped (computed by the command each row names) and the audit's CPU mode against a measured run."""

from functools import lru_cache

from .base import R, Figure

AUDIT_235B = "python recipes/qwen3_235b_grpo_spec.py --audit"
AUDIT_8B = "python recipes/qwen3_8b_grpo_spec.py --audit"
GB = 1e9


@lru_cache(maxsize=2)
def audited(command: str):
    """The audit the command prints, computed in this process: the recipe's config on its own layout, on H100s."""
    import importlib

    from launchers.checks import audit_of

    name = command.split("/")[1].split(".")[0]
    recipe = importlib.import_module(f"recipes.{name}")
    cfg = getattr(recipe, name)()
    found = audit_of(cfg, recipe.SCALE.layout(cfg), "h100")
    if not found.fits:
        raise ValueError(f"{name} does not fit: {found.problems}")
    return found


def trainer(command: str) -> list[float]:
    """The largest trainer rank's device total and the device's limit, GB."""
    ranks = [r for r in audited(command).ranks if r.kind.startswith("trainer")]
    top = max(ranks, key=lambda r: r.device_bytes)
    return [top.device_bytes / GB, top.device_limit / GB]


def head_stage(command: str) -> list[float]:
    """The last stage (where the online EAGLE-3 head trains): its device total, GB."""
    return [[r for r in audited(command).ranks if r.kind.startswith("trainer")][-1].device_bytes / GB]


def engine(command: str) -> list[float]:
    """An engine worker's total against its share of the device, and its weights, GB."""
    (e,) = [r for r in audited(command).ranks if r.kind.startswith("engine")]
    return [e.device_bytes / GB, e.device_limit / GB, e.parts["params"] / GB]


def host(command: str) -> list[float]:
    """The fullest node's host memory, GB."""
    return [max(audited(command).nodes.values()) / GB]


FIGURES: list[Figure] = [
    Figure(R, "82.0 of 85.5 GB", AUDIT_235B, lambda _: trainer(AUDIT_235B)),
    Figure(R, "last stage 80.3 GB", AUDIT_235B, lambda _: head_stage(AUDIT_235B)),
    Figure(R, "72.7 of 72.7 GB (weights 58.8 GB)", AUDIT_235B, lambda _: engine(AUDIT_235B)),
    Figure(R, "528 GB a node", AUDIT_235B, lambda _: host(AUDIT_235B)),
    Figure(R, "76.8 of 85.5 GB", AUDIT_8B, lambda _: trainer(AUDIT_8B)),
    Figure(R, "42.8 of 42.8 GB (weights 16.4 GB)", AUDIT_8B, lambda _: engine(AUDIT_8B)),
    Figure(R, "566 GB a node", AUDIT_8B, lambda _: host(AUDIT_8B)),
]
GIVEN: list = []
