"""Where the trainer ranks and the generation engines run: Ray placement-group bundles, as plain data.

`colocated`: one bundle per device; trainer rank r and engine i share bundle r / i and take turns on it (the engine
sleeps while the trainer updates). `disaggregated`: the trainer ranks and the engines get bundles of their own, and
weights are broadcast to the engines after each update. A bundle is one GPU where the cluster has GPUs; on a CPU
cluster it is an equal share of the cluster's CPUs (Ray's CPU counts are for scheduling; the actors pin their torch
threads to their share). Pure: `plan` is checked before any actor starts, and tested without Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One actor's place: its bundle and the resources it takes from it."""

    bundle: int
    cpus: float
    gpus: float

    @property
    def threads(self) -> int:
        """torch CPU threads for the actor: its whole CPUs, at least one."""
        return max(1, int(self.cpus + 1e-9))


@dataclass(frozen=True)
class Placement:
    kind: str
    """`colocated` or `disaggregated`."""
    trainer_world: int
    """Trainer ranks (one torch.distributed group)."""
    generators: int
    """Generation engines."""
    bundle: dict
    """Resources of one bundle, e.g. {"CPU": 1.0} or {"CPU": 4.0, "GPU": 1.0}."""

    @property
    def bundles(self) -> list[dict]:
        n = max(self.trainer_world, self.generators) if self.kind == "colocated" else self.trainer_world + self.generators
        return [dict(self.bundle) for _ in range(n)]

    def _slot(self, bundle: int) -> Slot:
        share = 0.5 if self.kind == "colocated" else 1.0  # two actors share a colocated bundle
        return Slot(bundle, self.bundle.get("CPU", 0.0) * share, self.bundle.get("GPU", 0.0) * share)

    def trainer(self, rank: int) -> Slot:
        return self._slot(rank)

    def generator(self, i: int) -> Slot:
        return self._slot(i if self.kind == "colocated" else self.trainer_world + i)


def trainer_world(cfg, layout: dict | None = None) -> int:
    """Trainer ranks: the layout's Megatron world (TP*PP*CP*DP) when the recipe gives one; else the smallest world
    the Megatron sizes fit (TP*PP*CP for dense layers and EP*ETP*PP for experts must both divide it); 1 for the
    embedded trainer, which is one process."""
    if cfg.backend.trainer == "embedded":
        return 1
    if layout and "megatron" in layout:
        m = layout["megatron"]
        return m["tp"] * m["pp"] * m["cp"] * m["dp"]
    m = cfg.backend.megatron
    return math.lcm(m.tp * m.pp * m.cp, m.ep * (m.etp or m.tp) * m.pp)


def plan(cfg, cluster: dict, layout: dict | None = None) -> Placement:
    """The placement for `cfg` on a cluster with `cluster` resources (Ray's `cluster_resources()`). Raises a
    ValueError naming what is short before any actor starts: more GPUs asked than the cluster has, or an engine
    count the layout contradicts."""
    kind = cfg.backend.placement
    if kind == "inline" and layout and "ray" in layout:  # an at-scale recipe left it to its layout
        kind = layout["ray"]["placement"]
    if kind not in ("colocated", "disaggregated"):
        raise ValueError(f"the Ray driver runs backend.placement colocated or disaggregated, got {kind!r}")
    world, engines = trainer_world(cfg, layout), cfg.backend.generators
    if cfg.backend.trainer == "megatron":
        m = layout["megatron"] if layout and "megatron" in layout else vars(cfg.backend.megatron)
        dp, rollouts = world // (m["tp"] * m["pp"] * m["cp"]), cfg.grpo.prompts_per_step * cfg.grpo.group_size
        if rollouts % dp:
            raise ValueError(f"the {rollouts} rollouts of a step (grpo.prompts_per_step x grpo.group_size) do not "
                             f"split evenly over the Megatron trainer's {dp} data-parallel ranks")
    if layout and layout.get("vllm", {}).get("engines") not in (None, engines) and engines != 1:
        raise ValueError(f"backend.generators={engines} but the recipe's layout has {layout['vllm']['engines']} "
                         "engines; leave backend.generators at 1 to take the layout's")
    if layout and engines == 1:
        engines = layout.get("vllm", {}).get("engines", 1)
    n = max(world, engines) if kind == "colocated" else world + engines
    gpus = float(cluster.get("GPU", 0))
    wants_gpu = bool(layout and layout.get("ray", {}).get("bundle", {}).get("GPU"))
    if wants_gpu or gpus:
        if n > gpus:
            raise ValueError(f"{kind} placement needs {n} GPUs ({world} trainer ranks, {engines} engines"
                             f"{'' if kind == 'colocated' else ' on separate GPUs'}), the Ray cluster has {gpus:g}")
        cpus = float(cluster.get("CPU", 0)) / gpus
        bundle = {"CPU": math.floor(cpus) or cpus, "GPU": 1.0}
    else:
        cpus = float(cluster.get("CPU", 0))
        if cpus <= 0:
            raise ValueError("the Ray cluster reports no CPUs")
        bundle = {"CPU": math.floor(cpus / n * 1e4) / 1e4}  # rounded down: n bundles must fit the cluster
    return Placement(kind, world, engines, bundle)
