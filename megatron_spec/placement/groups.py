"""The two worker groups as the RL loop sees them: `TrainerGroup` is a Policy, `GeneratorGroup` a Generator
(`megatron_spec.interfaces`), less what the Ray driver does its own way: the trainer's weights reach the engines
through a transport (`transport.py`) instead of `export_weights` / `update_weights`, and the engines wake and
sleep in their actors. Both groups run the whole-step gate where the classes in their actors do: `speculation`
is forwarded to the trainer's rank 0 and, call by call, to the engines (see `GeneratorGroup.speculation`).

The generator group splits a step's prompts over its engines with every GRPO group whole (one engine sees all of
a prompt's rollouts), gives engine j the seed offset j * SEED_STRIDE (engine 0 draws exactly what a single engine
draws), and, when an engine dies, starts a new one in the same bundle, loads it with the last synced weights and
re-issues the dead engine's prompts with the same seeds: the step completes with the same rollouts.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

from . import require_ray
from ..interfaces import no_step_gate
from ..distributed.process_groups import local_ranks, straddling_groups
from .bundles import Placement, Slot
from .workers import DeviceProbe, Engine, TrainerRank

BESIDE_GROUP = "beside"
"""An engine actor's second concurrency group with in-flight updates: refits (`Engine.receive_weights`) and the
driver's short calls (`Engine.memory`), which run while a generation does instead of after the ones queued."""
SEED_STRIDE = 1_000_000_007
"""Seed offset between engines: far above any step's seed, so no two engines or steps share a random stream."""


def split_groups(n_prompts: int, group_size: int, engines: int) -> list[tuple[int, int]]:
    """[lo, hi) prompt ranges, one per engine (engines without a group get none), GRPO groups never cut: the
    groups are dealt out in contiguous runs whose sizes differ by at most one."""
    groups = n_prompts // group_size
    if groups * group_size != n_prompts:
        raise ValueError(f"{n_prompts} prompts are not whole groups of {group_size}")
    base, extra = divmod(groups, engines)
    ranges, lo = [], 0
    for j in range(engines):
        hi = lo + (base + (j < extra)) * group_size
        if hi > lo:
            ranges.append((lo, hi))
        lo = hi
    return ranges


def _actor(cls, slot: Slot, pg, concurrency_groups: dict | None = None, **options):
    """`cls` as an actor in `slot`'s bundle; `concurrency_groups` are fixed with the class (Ray takes them there)."""
    ray = require_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundle)
    remote = ray.remote(concurrency_groups=concurrency_groups)(cls) if concurrency_groups else ray.remote(cls)
    return remote.options(num_cpus=slot.cpus, num_gpus=slot.gpus, scheduling_strategy=strategy, **options)


def engine_devices(placement: Placement, pg, j: int) -> list[str] | None:
    """The GPU id of each of engine j's workers as Ray assigns their bundles (a momentary probe per bundle), for
    `workers.share_devices`; None where the engine's actor sees all its GPUs itself (one bundle, or CPUs). Raises
    when the workers' bundles lie on two nodes: one engine's workers are processes of one actor."""
    if not placement.per_gpu:
        return None
    ray = require_ray()
    probes = [_actor(DeviceProbe, Slot(b, 0.0, 0.01), pg).remote() for b in placement.engine_bundles(j)]
    try:
        found = ray.get([p.device.remote() for p in probes])
    finally:
        for p in probes:
            ray.kill(p)
    if len({node for _, node in found}) > 1:
        raise RuntimeError(f"engine {j}'s {len(found)} workers were placed on {len({n for _, n in found})} nodes: an "
                           "engine of vLLM tensor parallel size t needs t GPUs of one node (GPUs per node a multiple "
                           "of t, ranks node-major)")
    return [gpu for gpu, _ in found]


class TrainerDied(RuntimeError):
    """A trainer rank died: the run stops (its checkpoints stay as they were)."""


def resume_hint(cfg) -> str:
    """Where the last good checkpoint is and the command that resumes from it (`run.resume` is on by default)."""
    run_dir = Path(cfg.run.out_dir)
    latest = run_dir / "checkpoints" / "latest"
    where = run_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None
    saved = f"The last good checkpoint is {where} (untouched)" if where else "No checkpoint was saved yet"
    return f"{saved}; resume with:\n  megatron-spec train --config {run_dir}/config.yaml"


def check_node_order(cfg, nodes: list[str]) -> None:
    """Refuse, before any rank joins a group, a placement that puts one Megatron TP group or expert group on two
    nodes (their collectives run every layer; across nodes they run at the network's speed, not NVLink's)."""
    if cfg.backend.trainer != "megatron":
        return
    meg = cfg.backend.megatron
    for what, size in (("TP", meg.tp), ("expert (EP x ETP)", meg.ep * (meg.etp or meg.tp))):
        split = straddling_groups(nodes, size)
        if split:
            raise RuntimeError(f"the placement puts Megatron {what} group(s) {split} of {size} ranks on two nodes: "
                               "ranks must be node-major (slurm/ray.sub's RANKS_BY_NODE; a group size that divides "
                               "the devices of a node)")


class TrainerGroup:
    """The trainer ranks behind the Policy interface. The driver calls rank 0; a sharded (Megatron) trainer's
    rank 0 announces each call to the other ranks, which follow it (`TrainerRank.follow`)."""

    plain = False  # inside speculation(False)

    def __init__(self, cfg, placement: Placement, pg):
        ray = require_ray()
        self.cfg = cfg
        self.ranks = [_actor(TrainerRank, placement.trainer(r), pg).remote(cfg, r, placement.trainer_world,
                                                                           placement.trainer(r).threads)
                      for r in range(placement.trainer_world)]
        timeout = cfg.backend.init_timeout_s
        addresses = ray.get([r.address.remote(True) for r in self.ranks], timeout=timeout)
        master = addresses[0][:2] if len(self.ranks) > 1 else None
        nodes = [node for _, _, node in addresses]
        locals_ = local_ranks(nodes)  # LOCAL_RANK: the index on its own node
        check_node_order(cfg, nodes)
        self.followers = cfg.backend.trainer == "megatron" and len(self.ranks) > 1
        setups = [r.setup.remote(master, locals_[i], self.followers and i > 0) for i, r in enumerate(self.ranks)]
        self.follows = [r.follow.remote() for r in self.ranks[1:]] if self.followers else []
        ready, _ = ray.wait(setups, num_returns=len(setups), timeout=timeout)
        if len(ready) < len(setups):
            late = [i for i, ref in enumerate(setups) if ref not in ready]
            raise RuntimeError(f"trainer rank(s) {late} did not start within backend.init_timeout_s={timeout:g} s")
        self.joined = ray.get(setups)[0]  # a rank that failed to join raises here, naming the missing ranks

    @property
    def supports_step_gate(self) -> bool:
        """Rank 0's policy's answer (the embedded trainer's yes; the Megatron policy trains its drafter inside its
        own schedule and has no plain step), asked once."""
        if not hasattr(self, "_supports_step_gate"):
            self._supports_step_gate = self.call("supports_step_gate")
        return self._supports_step_gate

    @contextmanager
    def speculation(self, enabled: bool):
        """With `enabled` False, rank 0's policy trains inside the block as its own `speculation(False)` does
        (the drafter left out); refused, as `no_step_gate` refuses it, by a trainer without the gate."""
        if enabled:
            yield
            return
        if not self.supports_step_gate:
            with no_step_gate(self, enabled):
                yield
            return
        self.call("speculation", False)
        self.plain = True
        try:
            yield
        finally:
            self.plain = False
            self.call("speculation", True)

    @property
    def trains_drafter_online(self) -> bool:
        """Rank 0's policy's answer (asked once: only `speculation` changes it), False inside
        `speculation(False)`."""
        if not hasattr(self, "_trains_drafter_online"):
            self._trains_drafter_online = self.call("trains_drafter_online")
        return self._trains_drafter_online and not self.plain

    def call(self, method: str, *args):
        """`method(*args)` on rank 0. A dead rank raises TrainerDied: rank 0's own death directly; a follower's
        when rank 0's next collective fails, or its `follow` call reports it."""
        ray = require_ray()
        try:
            ref = getattr(self.ranks[0], method).remote(*args)
            ready, _ = ray.wait([ref, *self.follows], num_returns=1)
            if ready[0] != ref:  # a follower ended (died, or its follow() failed) while rank 0 was being called
                try:
                    ray.get(ready[0])
                    why = "returned"
                except ray.exceptions.RayError as err:
                    why = f"failed: {err}"
                raise TrainerDied(f"a trainer follower {why} during {method}; the run stops.\n"
                                  f"{resume_hint(self.cfg)}")
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise TrainerDied(f"a trainer rank died during {method} ({type(err).__name__}); the run stops.\n"
                              f"{resume_hint(self.cfg)}") from err

    def train_step(self, batch, drafter_extra=None, drafter_budget_s=None) -> dict:
        metrics, old = self.call("train_step", batch, drafter_extra, drafter_budget_s)
        batch.old_logprobs = old  # the loop's mismatch metric reads them, as in one process
        return metrics

    def logprobs(self, batch):
        return self.call("logprobs", batch)

    def offload(self) -> dict:
        return self.call("offload")

    def export(self, bucket_bytes: int) -> tuple[list, int, float]:
        return self.call("export", bucket_bytes)

    def state_dict(self) -> dict:
        return self.call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self.call("load_state_dict", state)

    @classmethod
    def of(cls, cfg, placement: Placement, pg) -> "TrainerGroup":
        """The group for `cfg`'s trainer: a Megatron trainer's checkpoints are written shard by shard by every rank."""
        return (ShardedTrainerGroup if cfg.backend.trainer == "megatron" else cls)(cfg, placement, pg)

    def close(self) -> None:
        ray = require_ray()
        if self.followers:
            try:
                ray.get(self.ranks[0].stop.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # a dead rank 0: the followers are killed below
        for r in self.ranks:
            ray.kill(r)


class ShardedTrainerGroup(TrainerGroup):
    """A Megatron trainer's group: `rl.checkpoint.Saver` finds `save_sharded` and every rank writes its own shards
    (Megatron-Core `torch_dist`, the followers taking part through rank 0's announcement); nothing is gathered.
    In the background each rank actor's thread writes its shards while the driver runs the next step; the driver's
    `Saver.poll` / `wait` then call `finish_save`, which every rank runs together, before the directory is named."""

    def save_sharded(self, out_dir, background: bool = False, writer: str = "process") -> dict:
        return self.call("save_sharded", str(out_dir), background, writer)

    def save_done(self) -> bool:
        return self.call("save_done")

    def finish_save(self) -> float | None:
        return self.call("finish_save")


@dataclasses.dataclass
class Pending:
    """Rollouts in flight: each engine's share of one `generate` call."""

    prompts: list
    params: object
    parts: list
    """(engine index, lo, hi, engine handle, object reference)."""
    speculate: bool = True
    """The mode the rollouts are generated in (`GeneratorGroup.speculation` when submitted); a re-issue keeps it."""


class GeneratorGroup:
    def __init__(self, cfg, placement: Placement, pg):
        self.cfg, self.placement, self.pg = cfg, placement, pg
        self.colocated = placement.kind == "colocated"
        self.engines = [self._start(j) for j in range(placement.generators)]
        require_ray().get([e.ready.remote() for e in self.engines])  # built, so the first sync times only the sync
        self.weights: tuple[int, list] | None = None  # the last synced (version, bucket references), object store
        self.sent = -1  # the newest version sent to the engines: a generation submitted after it starts with it
        self.reconnect = None  # set by the collective transport: re-forms its group and resends the weights
        self.restarts = 0
        self.speculate = True  # the mode of the generations submitted now (`speculation`)

    @property
    def supports_step_gate(self) -> bool:
        """Whether the engines' generator runs plain steps (our engine and vLLM's do), asked of engine 0 once."""
        if not hasattr(self, "_supports_step_gate"):
            self._supports_step_gate = require_ray().get(self.beside(self.engines[0], "supports_step_gate").remote())
        return self._supports_step_gate

    @contextmanager
    def speculation(self, enabled: bool):
        """With `enabled` False, the generations submitted inside the block run without speculation.

        The mode is a generation's, fixed when it is submitted (`Pending.speculate`): each engine runs a call
        inside its generator's own `speculation`, one call at a time, so no engine switches while it generates,
        and a refit taken in flight continues the call's rollouts in the same mode. A plain step is then a step
        whose rollouts were all generated plainly: with `backend.async_lag` 0 the step's own submissions; with a
        lag the driver gives each submission the mode the gate chose for the step that will train on it."""
        if not enabled and not self.supports_step_gate:
            with no_step_gate(self, enabled):
                yield
            return
        saved, self.speculate = self.speculate, self.speculate and enabled
        try:
            yield
        finally:
            self.speculate = saved

    def sent_weights(self, version: int) -> None:
        """`version` is the newest sent to the engines: a generation submitted from now on waits for it."""
        self.sent = version

    def _start(self, j: int):
        slot = self.placement.generator(j)
        threads = self.cfg.backend.vllm.threads or slot.threads
        devices = engine_devices(self.placement, self.pg, j)
        if not self.cfg.backend.in_flight_updates:
            return _actor(Engine, slot, self.pg).remote(self.cfg, threads, j, devices)
        # Refits in a thread of their own, handed to the generating thread between two steps; they must not wait
        # for the generate calls submitted before them, which Ray's in-order execution would make them do.
        return _actor(Engine, slot, self.pg, {BESIDE_GROUP: 1},
                      allow_out_of_order_execution=True).remote(self.cfg, threads, j, devices)

    def beside(self, engine, method: str):
        """`engine.method` to be called beside generation: in the engine's second concurrency group with in-flight
        updates (it runs while a generation does), else queued behind whatever the engine is generating."""
        call = getattr(engine, method)
        return call.options(concurrency_group=BESIDE_GROUP) if self.cfg.backend.in_flight_updates else call

    def sync(self, version: int, refs: list) -> list:
        """Send the buckets to every engine; the load futures."""
        self.weights = (version, refs)
        return [self.beside(e, "update_weights").remote(version, refs) for e in self.engines]

    def submit(self, prompts: list, params, group_size: int, speculate: bool | None = None) -> Pending:
        """Generate `prompts` on the engines, each its share of whole groups, in mode `speculate` (None: the
        mode `speculation` holds now)."""
        mode = self.speculate if speculate is None else speculate
        parts = []
        for j, (lo, hi) in enumerate(split_groups(len(prompts), group_size, len(self.engines))):
            parts.append((j, lo, hi, self.engines[j], self._generate(j, prompts[lo:hi], params, mode)))
        return Pending(prompts, params, parts, mode)

    def _generate(self, j: int, prompts: list, params, speculate: bool):
        seeded = dataclasses.replace(params, seed=params.seed + j * SEED_STRIDE)
        return self.engines[j].generate.remote(prompts, seeded, self.colocated, self.sent, speculate)

    def collect(self, pending: Pending) -> tuple[list, list[float]]:
        """The rollouts in prompt order (each token's policy version in `Completion.versions`) and each engine's
        generation seconds; an engine that died is replaced and its share re-issued."""
        ray = require_ray()
        outs, seconds = [None] * len(pending.prompts), []
        for j, lo, hi, handle, ref in pending.parts:
            while True:
                try:
                    part, took = ray.get(ref)
                    break
                except ray.exceptions.RayActorError:
                    if self.engines[j] is handle:  # not replaced yet by an earlier share's failure
                        self._restart(j)
                    handle = self.engines[j]
                    ref = self._generate(j, pending.prompts[lo:hi], pending.params, pending.speculate)
            outs[lo:hi] = part
            seconds.append(took)
        return outs, seconds

    def _restart(self, j: int) -> None:
        ray = require_ray()
        ray.kill(self.engines[j])
        self.engines[j] = self._start(j)
        ray.get(self.engines[j].ready.remote())
        self.restarts += 1
        if self.reconnect is not None:
            self.reconnect()
        elif self.weights is not None:
            ray.get(self.engines[j].update_weights.remote(*self.weights))

    def memory(self) -> list[dict]:
        """Each engine's peak memory since the last call (`Engine.memory`)."""
        return require_ray().get([self.beside(e, "memory").remote() for e in self.engines])

    def generate(self, prompts: list, params) -> list:
        """The Generator interface (greedy evaluation): one call over all engines, prompts split evenly."""
        return self.collect(self.submit(prompts, params, 1))[0]

    def close(self) -> None:
        ray = require_ray()
        try:
            ray.get([e.close.remote() for e in self.engines], timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead or stuck engine: killing its actor below is all that is left
        for e in self.engines:
            ray.kill(e)
