"""Where the trainer ranks and the generation engines run: Ray placement-group bundles, as plain data.

`colocated`: trainer ranks and engines share devices and take turns on them (the engine sleeps while the trainer
updates). On GPUs every GPU is a bundle of its own, shared by trainer rank r and engine worker r (worker w of
engine j is worker j * t + w for engines of vLLM tensor parallel size t): the engine's actor sits in its first
worker's bundle and its t workers (vLLM's processes) are pointed at the GPUs of their t bundles
(`Placement.engine_bundles`, `groups.engine_devices`), so each worker shares its GPU with one trainer rank. On CPUs
an engine's t units are one bundle, so its workers sit on one node. `disaggregated`: the trainer ranks and the
engines get bundles of their own (an engine's t units tied in one), and weights are broadcast to the engines after
each update. A bundle is one GPU where the cluster has GPUs; on a CPU cluster it is an equal share of the
cluster's CPUs (Ray's CPU counts are for scheduling; the actors pin their torch threads to their share). Pure:
`plan` is checked before any actor starts, and tested without Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import colocation_problems


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
    """Resources of one device unit, e.g. {"CPU": 1.0} or {"CPU": 4.0, "GPU": 1.0}."""
    engine_tp: int = 1
    """Device units of one engine (vLLM tensor parallel size): one bundle, so they sit on one node; colocated on
    GPUs one bundle each, checked to lie on one node when the engine starts (`groups.engine_devices`)."""

    @property
    def per_gpu(self) -> bool:
        """Colocated on GPUs: one bundle per GPU, a trainer rank and an engine worker in each (the engine's workers
        spread over consecutive bundles)."""
        return self.kind == "colocated" and bool(self.bundle.get("GPU"))

    @property
    def bundles(self) -> list[dict]:
        """Colocated on GPUs: one bundle per GPU (`per_gpu`). Otherwise engine j's units are one bundle (tied).
        Colocated: engine bundles first, trainer rank r in the bundle holding unit r (ranks beyond the engines'
        units get single-unit bundles); disaggregated: one bundle per trainer rank, then the engines'."""
        unit, t = self.bundle, self.engine_tp
        engine = {k: v * t for k, v in unit.items()}
        if self.per_gpu:
            return [dict(unit) for _ in range(max(self.trainer_world, self.generators * t))]
        if self.kind == "colocated":
            extra = max(0, self.trainer_world - self.generators * t)
            return [dict(engine) for _ in range(self.generators)] + [dict(unit) for _ in range(extra)]
        return [dict(unit) for _ in range(self.trainer_world)] + [dict(engine) for _ in range(self.generators)]

    def _slot(self, bundle: int, units: int) -> Slot:
        share = 0.5 if self.kind == "colocated" else 1.0  # two actors share each colocated unit
        return Slot(bundle, self.bundle.get("CPU", 0.0) * share * units, self.bundle.get("GPU", 0.0) * share * units)

    def trainer(self, rank: int) -> Slot:
        if self.per_gpu:
            return self._slot(rank, 1)
        if self.kind == "colocated":
            engine_units = self.generators * self.engine_tp
            return self._slot(rank // self.engine_tp if rank < engine_units else
                              self.generators + rank - engine_units, 1)
        return self._slot(rank, 1)

    def generator(self, i: int) -> Slot:
        """Engine i's actor. Per GPU it takes its share of its first worker's GPU only: its other workers' shares
        stay free in their bundles, which nothing else of the run's placement group takes."""
        if self.per_gpu:
            return self._slot(self.engine_bundles(i)[0], 1)
        return self._slot(i if self.kind == "colocated" else self.trainer_world + i, self.engine_tp)

    def engine_bundles(self, i: int) -> list[int]:
        """The bundle of each of engine i's workers, by worker (vLLM's local rank): per GPU its own bundle, bundle
        i * t + w, whose GPU trainer rank i * t + w shares; otherwise the engine's one bundle for every worker."""
        if self.per_gpu:
            return [i * self.engine_tp + w for w in range(self.engine_tp)]
        return [self.generator(i).bundle] * self.engine_tp

    def gpu_peer(self, worker: int) -> int | None:
        """The trainer rank that shares a GPU with engine worker `worker` (engine j's worker w is j * t + w), None
        where no rank does (disaggregated, CPUs, or more engine workers than trainer ranks)."""
        return worker if self.per_gpu and worker < self.trainer_world else None


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
    tp = engine_tp(cfg, layout)
    n = max(world, engines * tp) if kind == "colocated" else world + engines * tp
    gpus = float(cluster.get("GPU", 0))
    wants_gpu = bool(layout and layout.get("ray", {}).get("bundle", {}).get("GPU"))
    if wants_gpu or gpus:
        if n > gpus:
            raise ValueError(f"{kind} placement needs {n} GPUs ({world} trainer ranks, {engines} engines of "
                             f"{tp} GPU(s){'' if kind == 'colocated' else ' on separate GPUs'}), the Ray cluster "
                             f"has {gpus:g}")
        for problem in colocation_problems(kind == "colocated", tp, gpus_per_node=_gpus_per_node(cluster)):
            raise ValueError(problem)  # the rule the tuner and launch checks read
        cpus = float(cluster.get("CPU", 0)) / gpus
        bundle = {"CPU": math.floor(cpus) or cpus, "GPU": 1.0}
    else:
        cpus = float(cluster.get("CPU", 0))
        if cpus <= 0:
            raise ValueError("the Ray cluster reports no CPUs")
        bundle = {"CPU": math.floor(cpus / n * 1e4) / 1e4}  # rounded down: n bundles must fit the cluster
    return Placement(kind, world, engines, bundle, tp)


def _gpus_per_node(cluster: dict) -> int | None:
    """GPUs of one node where Ray's `cluster_resources()` says how many nodes there are (`node:<ip>` keys)."""
    nodes = sum(1 for k in cluster if k.startswith("node:") and k != "node:__internal_head__")
    return int(cluster.get("GPU", 0)) // nodes if nodes else None


def engine_tp(cfg, layout: dict | None = None) -> int:
    """Device units per engine: vLLM's tensor parallel size (the recipe layout's when it gives one); 1 for ours."""
    if cfg.backend.generator != "vllm":
        return 1
    if layout and layout.get("vllm", {}).get("tensor_parallel_size"):
        return int(layout["vllm"]["tensor_parallel_size"])
    return cfg.backend.vllm.tensor_parallel_size
