"""The at-scale driver: `train(cfg, layout=None)` runs the RL loop of `megatron_spec.rl.loop` (its stages,
metrics, logging, checkpoints and report; no second copy) with the trainer and the generators in Ray worker groups.

    for step:  data -> prepare (weight sync) -> gen (rollouts, possibly run ahead) -> logprob -> train

What differs from one process is only where the pieces live (`build_backends`), how weights reach the engines
(`refit`: one trainer rank per pipeline stage streams that stage's packed buckets of HF-named tensors, policy and
drafter, through a weight-update group to every engine worker, or rank 0 through Ray's object store as the
fallback, `transport.py`; logged as `weight_sync_bytes` / `_s` / `_gbps` / `_transport` / `_senders` /
`_sender_bytes_max` / `_received_bytes_max` / `_wait_s`) and how rollouts are made (`rollouts`).

Async GRPO (`backend.async_lag = L > 0`): before waiting for step s's rollouts the driver has submitted generation
for every step up to s + L, each with the newest weights it had; engines run those while the trainer updates. Every
token comes back with the policy version of the weights that sampled it; step s's `policy_lag` is the trainer's
version minus the oldest of them, never above L (at step s the trainer is at version s, and step s's generation was
submitted at step s - L or later, after that step's sync). The loss then corrects each token with its own behaviour
log-prob (`is_clip_frac` logged). The drafter is synced in the same stream with the same version, so it always
drafts for the policy whose rollouts it speeds up.

Without in-flight updates an engine takes a refit only between two generate calls (one call at a time per actor),
so no request mixes two versions; but with the collective transport the trainer's stream needs every engine at
once, so it waits for the generation already queued on them (lag 2 then behaves as lag 1). With
`backend.in_flight_updates` an engine takes it between two decoding steps of the generation it runs (its running
rollouts' keys and values recomputed under the new weights, `LLMEngine.refit`), so the senders wait about one
decoding step (`weight_sync_wait_s`, beside the engines' `engine_generate_s`) and rollouts may span versions
(`rollout_version_span_max`, `rollout_versions_mean`). With L = 0 the step is exactly the in-process step.
"""

from __future__ import annotations

import os
import sys
import time

from ..rl import loop
from ..interfaces import Rollouts
from . import require_ray
from .groups import GeneratorGroup, TrainerDied, TrainerGroup
from .bundles import plan
from .transport import TRANSPORTS, resolve, sync_metrics


PLACEMENT_TIMEOUT_S = 120
"""How long the driver waits for Ray to reserve the bundles before it says which resources are missing."""


class RayTrainer(loop.Trainer):
    """The loop's Trainer with its policy and generator in Ray worker groups."""

    def __init__(self, cfg, layout: dict | None = None):
        self.layout = layout
        self.version = 0  # updates applied by the trainer: the policy version
        self.synced = -1  # the version last sent to the engines
        self.pending: dict[int, object] = {}  # step -> rollouts in flight
        self.modes: dict[int, bool | None] = {}  # step -> the gate's mode for its generation (with a lag)
        self.sync_futures: list = []
        self.offload_info: dict = {}  # the last offload's memory metrics (colocated)
        self.sync_info = {"weight_sync_bytes": 0, "weight_sync_s": 0.0, "weight_sync_gbps": 0.0,
                          "weight_sync_transport": cfg.backend.refit_transport, "weight_sync_senders": 0,
                          "weight_sync_sender_bytes_max": 0, "weight_sync_received_bytes_max": 0,
                          "weight_sync_wait_s": 0.0}
        super().__init__(cfg)

    def build_backends(self):
        ray = require_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        self.placement = plan(self.cfg, ray.cluster_resources(), self.layout)
        pg = placement_group(self.placement.bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(pg)
            raise RuntimeError(f"Ray could not place {self.placement.bundles} within {PLACEMENT_TIMEOUT_S} s on a "
                               f"cluster with {ray.available_resources()} free") from err
        self.pg = pg
        trainer = TrainerGroup.of(self.cfg, self.placement, self.pg)
        generator = GeneratorGroup(self.cfg, self.placement, self.pg)
        self.transport = TRANSPORTS[self.cfg.backend.refit_transport](self.cfg, trainer, generator)
        return trainer, generator

    def step(self, step: int) -> dict:
        metrics = super().step(step)
        self.version += 1
        return metrics

    @property
    def serial(self) -> bool:
        return self.cfg.backend.async_lag == 0

    def step_mode(self, step: int) -> bool | None:
        """The mode of the step's rollouts. With a lag the gate decides each generation's mode when it is
        submitted (`submit`, up to L steps ahead, from the costs recorded by then), and the step that trains on
        those rollouts takes their mode: its drafter trains exactly when they were speculated."""
        if self.serial or self.gate is None:
            return super().step_mode(step)
        return self.modes.setdefault(step, self.gate.speculate())

    def generation_cost(self, timer, rollouts: Rollouts, drafter_s: float) -> tuple[float, float | None]:
        """With a lag the gen stage times only the wait for rollouts generated beside the previous steps, so the
        gate prices the engines' own generation seconds against the trainer's side of the step (all its other
        stages, less the drafter's training, which the gate adds per mode)."""
        if self.serial:
            return super().generation_cost(timer, rollouts, drafter_s)
        other = sum(t for name, t in timer.times.items() if name != "gen")
        return rollouts.metrics["engine_generate_s"], other - drafter_s

    def loop_state(self) -> dict:
        """The loop's state and the modes the gate chose for generations already submitted, so a resumed run
        generates each step in the mode the uninterrupted run did."""
        return {**super().loop_state(), "modes": {str(s): m for s, m in self.modes.items()}}

    def load_loop_state(self, saved: dict) -> None:
        super().load_loop_state(saved)
        self.modes = {int(s): m for s, m in (saved.get("modes") or {}).items()}

    def refit(self) -> None:
        """Send the trainer's weights when they are newer than the engines'; wait for the engines to load them
        when synchronous (with a lag they load after the generation already queued, or with in-flight updates at
        the next decoding step of the one running)."""
        if self.synced == self.version:
            return
        if self.placement.kind == "colocated":  # the engines wake on the trainer's devices: make room first
            self.offload_info = self.policy.offload()
        t0 = time.perf_counter()
        pending = self.transport.start(self.version)
        self.synced = self.version
        self.generator.sent_weights(self.version)
        if self.cfg.backend.async_lag == 0:
            metrics = sync_metrics(self.transport, resolve(pending))
            wall = time.perf_counter() - t0
            self.sync_info = {**metrics, "weight_sync_s": wall,
                              "weight_sync_gbps": metrics["weight_sync_bytes"] / wall / 1e9}
        else:  # how long the engines took to load them is known once they have
            self.sync_futures.append(pending)

    def rollouts(self, step: int, prompts: list[list[int]]) -> Rollouts:
        last = self.cfg.run.steps - 1
        ahead = step + self.cfg.backend.async_lag
        if step not in self.pending:
            self.pending[step] = self.submit(step, prompts)
        for s in range(step + 1, min(ahead, last) + 1):
            if s not in self.pending:
                self.pending[s] = self.submit(s, self.draw(s)[1])
        outs, seconds = self.generator.collect(self.pending.pop(step))
        self.modes.pop(step, None)
        ages = [self.version - min(o.versions, default=self.version) for o in outs]  # from each oldest token
        lag = max(ages)
        metrics = {"policy_lag": lag, "generator_restarts": self.generator.restarts, **self.sync_metrics(),
                   **version_metrics(outs), "engine_generate_s": max(seconds), "engine_memory": self.engine_memory()}
        if self.offload_info:
            metrics["trainer_offload"] = dict(self.offload_info)
        return Rollouts(outs, lag, metrics, ages)

    def engine_memory(self) -> dict:
        """Every engine's peak resident memory since the last step, MB, by engine: its actor process and the sum
        of its vLLM worker processes (CUDA peaks on GPUs)."""
        ray = require_ray()
        try:
            per = self.generator.memory()
        except ray.exceptions.RayActorError:  # a dead engine: replaced at its next generate call
            return {}
        out = {"engine_peak_rss_mb": [m.get("loop_peak_rss_mb") for m in per],
               "engine_workers_peak_rss_mb": [sum(m.get("children_peak_rss_mb", [])) for m in per]}
        for key in sorted({k for m in per for k in m if k.startswith("cuda_")}):
            out[f"engine_{key}"] = [m.get(key) for m in per]
        return out

    def submit(self, step: int, prompts: list[list[int]]):
        mode = None if self.serial else self.step_mode(step)  # serial: the mode the loop's step holds
        return self.generator.submit(prompts, self.sampling_params(step), self.cfg.grpo.group_size, mode)

    def sync_metrics(self) -> dict:
        """The last completed refit's bytes, seconds, GB/s and transport (asynchronously: from each side's own
        timing, see `transport.py`)."""
        ray = require_ray()
        while self.sync_futures and all(_done(f) for f in self.sync_futures[0] if isinstance(f, ray.ObjectRef)):
            pending = self.sync_futures.pop(0)
            results = []
            for f in pending:
                try:
                    results.append(resolve([f])[0])
                except ray.exceptions.RayActorError:  # a dead engine: its replacement was loaded on restart
                    pass
            if results:
                self.sync_info = sync_metrics(self.transport, results)
        return dict(self.sync_info)

    def evaluate(self) -> float:
        """Greedy accuracy of the current policy: waits for the generation in flight, then syncs."""
        ray = require_ray()
        accuracy = super().evaluate()
        ray.get([f for pending in self.sync_futures for f in pending if isinstance(f, ray.ObjectRef)])
        return accuracy

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in ("policy", "generator"):
            if hasattr(self, group):
                getattr(self, group).close()
        if hasattr(self, "pg"):
            remove_placement_group(self.pg)


def version_metrics(outs) -> dict:
    """How many policy versions the rollouts' tokens span: the most of one rollout (max - min + 1) and the mean
    number of distinct versions in a rollout (1.0 when no engine switched weights mid-rollout)."""
    versions = [o.versions for o in outs if o.versions]
    if not versions:
        return {}
    return {"rollout_version_span_max": max(max(v) - min(v) + 1 for v in versions),
            "rollout_versions_mean": sum(len(set(v)) for v in versions) / len(versions)}


def _done(ref) -> bool:
    ray = require_ray()
    return bool(ray.wait([ref], timeout=0)[0])


def train(cfg, layout: dict | None = None) -> dict:
    """Run (or resume) `cfg` on the Ray cluster at `RAY_ADDRESS`, or on a local one started here (and stopped at
    the end). `layout`: the recipe's cluster layout (`recipes/_common.py::Scale.layout`), or None to derive it from
    `cfg.backend`. Returns the last step's metrics, as `megatron_spec.rl.loop.train`."""
    from ..models.hub import resolve_config
    from ..rl.backends import GENERATORS, POLICIES, resolve

    cfg = resolve_config(cfg)  # hub names fetched on this machine, into model.hub_cache, which the workers read
    loop.check_inputs(cfg)
    ray = require_ray()
    resolve(POLICIES, cfg.backend.trainer, "trainer")  # a missing extra fails here, before Ray starts
    resolve(GENERATORS, cfg.backend.generator, "generator")
    started = not ray.is_initialized()
    if started:
        # "local": a new cluster for this run, never one that another process on this machine happens to run
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=True)
    try:
        return loop.run(cfg, lambda c: RayTrainer(c, layout))
    except TrainerDied as err:
        print(f"error: {err}", file=sys.stderr)
        raise
    finally:
        if started:
            ray.shutdown()
