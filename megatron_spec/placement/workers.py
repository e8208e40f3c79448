"""The Ray actors: a trainer rank and a generation engine. Plain classes, made remote by `groups.py`.

Each actor builds its own piece from the run's config (`rl.backends.build_policy` / `build_generator`, so the
embedded, Megatron and vLLM classes all fit), pins its torch threads, and speaks in plain Python values and
tensors. Weights travel through a weight-update group (`distributed/weight_group.py`): trainer rank 0 streams the
buckets it exports, every engine worker receives them (`join_weights` / `send_weights` / `receive_weights`). The
fallback (`backend.refit_transport=object_store`) passes lists of object-store references to the buckets; the
engine fetches them itself, so the driver never holds a copy.

With `backend.in_flight_updates` an engine actor runs its refits in a concurrency group of their own: a refit that
arrives while a generation runs in the actor's other thread is loaded by that thread between two decoding steps
(`LLMEngine.refit`), so the senders wait for one step, not for the generation and the ones queued behind it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time


def loads_whole_policy(cfg, which: str) -> bool:
    """Whether the actor building `which` ("policy" or "generator") loads the whole policy in float32. With a
    Megatron trainer none does: every trainer rank reads its own shards, and a vLLM engine starts from the checkpoint
    files in the dtype they hold (as the in-process loop does). Our engine, which is not sharded, loads the policy
    into its own process. The memory audit (`launchers/audit.py`) counts host memory by this rule."""
    return not (cfg.backend.trainer == "megatron" and (which == "policy" or cfg.backend.generator == "vllm"))


def _build(cfg, which: str):
    """The actor's policy or generator, loaded as `loads_whole_policy` says."""
    from ..models import from_pretrained
    from ..rl.backends import build_generator, build_policy
    from ..rl.loop import load_drafter_for

    build = build_policy if which == "policy" else build_generator
    if not loads_whole_policy(cfg, which):
        return build(cfg, None, None)
    model = from_pretrained(cfg.model.policy)
    return build(cfg, model, load_drafter_for(cfg, model))


class CrashHook:
    """A fault drill: `arm(method)` makes the actor's next call of `method` end its process (`os._exit`) after the
    work is done and before the answer leaves, which is how a worker lost mid-step looks to the driver."""

    def __init__(self):
        self.armed: str | None = None

    def arm(self, method: str) -> None:
        self.armed = method

    def check(self, method: str) -> None:
        if self.armed == method:
            os._exit(1)


class TrainerRank:
    """Rank `rank` of the trainer group. With more than one rank the group is one torch.distributed process group
    (gloo on CPU, NCCL on GPUs), set up before the policy is built, so a Megatron policy finds it initialised.

    A sharded trainer follows `MegatronPolicy`'s protocol: the driver calls rank 0 only, which announces each call
    to the other ranks; those wait in `follow` (which builds their policy from rank 0's announced config) and make
    the same calls. A one-rank trainer (the embedded one) is simply called."""

    def __init__(self, cfg, rank: int, world: int, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.policy = None
        self.plain: contextlib.ExitStack | None = None  # the policy's `speculation(False)`, while the driver holds it
        self.crash = CrashHook()

    def address(self, rendezvous: bool = False) -> tuple[str, int, str]:
        """This node's address, the port of the group this rank hosts (`host_port`) and the node's Ray id."""
        import ray

        host, port = self.host_port(rendezvous)
        return host, port, ray.get_runtime_context().get_node_id()

    def host_port(self, rendezvous: bool = False) -> tuple[str, int]:
        """This node's address and, on rank 0, the port of the rendezvous it now holds bound for a group it will
        host (0 elsewhere): the trainer's own group's (`rendezvous`, when there is more than one rank) on the
        launcher's `rendezvous_port`, else the weight-update group's on `weights_port`; without a fixed port the
        OS picks one as the store binds it, so no other process can take it first (`host_rendezvous`)."""
        from ..distributed.process_groups import host_rendezvous, node_address, rendezvous_port, weights_port

        host = node_address()
        if self.rank != 0 or (rendezvous and self.world == 1):
            return host, 0
        return host, host_rendezvous(host, rendezvous_port() if rendezvous else weights_port())

    def close_weights(self) -> None:
        """Rank 0: close the weight-update group it hosts (its store's port with it), so that the group can form
        again on the same fixed port (`CollectiveRefit.reconnect`)."""
        for owner, attr in ((self, "weights"), (self.policy, "weight_group")):
            group = getattr(owner, attr, None)
            if group is not None:
                group.close()
                setattr(owner, attr, None)

    def setup(self, master: tuple[str, int] | None, local_rank: int, follower: bool) -> int:
        """Join the trainer's process group (when world > 1: gloo on CPUs, NCCL on the GPU `local_rank` picks, the
        start-up timeout `backend.init_timeout_s`) and, unless this rank is a `follower`, build the policy; returns
        the ranks the group counted (== world when every rank joined)."""
        if self.world > 1:
            from ..distributed.process_groups import start_process_group

            start_process_group(self.rank, self.world, local_rank, master[0], master[1],
                                self.cfg.backend.init_timeout_s)
        if not follower:
            self.policy = _build(self.cfg, "policy")
        return self.world

    def follow(self) -> None:
        """Ranks > 0 of a sharded trainer: build the policy rank 0 announces and make its calls until it stops."""
        from ..trainers.megatron.launch import follow_run

        follow_run()

    def stop(self) -> None:
        """Rank 0: release the followers (a policy without followers has nothing to release)."""
        if hasattr(self.policy, "stop"):
            self.policy.stop()

    def offload(self) -> dict:
        """Colocated: release the optimizer states, masters and gradients while the engines generate (a sharded
        policy on every rank); the memory metrics (`distributed.offload`)."""
        from ..distributed import offload

        return self.policy.offload() if hasattr(self.policy, "offload") else offload.offload(self.policy)

    def _onload(self) -> dict:
        from ..distributed import offload

        return self.policy.onload() if hasattr(self.policy, "onload") else offload.onload(self.policy)

    def train_step(self, batch, drafter_extra=None, drafter_budget_s=None):
        """One update (first taking back what an offload released); returns the metrics and the old log-probs the
        step used (filled in when folded). `drafter_extra`: rows only the drafter learns from; `drafter_budget_s`:
        the whole-step gate's budget of the drafter's training (embedded trainer; the loop passes them only there)."""
        back = self._onload()
        extra = {k: v for k, v in (("drafter_extra", drafter_extra), ("drafter_budget_s", drafter_budget_s))
                 if v is not None}
        metrics = self.policy.train_step(batch, **extra)
        if back:
            metrics["memory"] = {**metrics.get("memory", {}), **back}
        self.crash.check("train_step")
        return metrics, batch.old_logprobs

    def logprobs(self, batch):
        return self.policy.logprobs(batch)

    def trains_drafter_online(self) -> bool:
        return self.policy.trains_drafter_online

    def supports_step_gate(self) -> bool:
        return self.policy.supports_step_gate

    def speculation(self, enabled: bool) -> None:
        """Enter the policy's `speculation(False)` (the driver's plain step, held across its calls) or, with
        `enabled`, leave it."""
        if not enabled and self.plain is None:
            self.plain = contextlib.ExitStack()
            self.plain.enter_context(self.policy.speculation(False))
        elif enabled and self.plain is not None:
            self.plain, plain = None, self.plain
            plain.close()

    def export(self, bucket_bytes: int) -> tuple[list, int, float]:
        """The policy and drafter weights as object-store buckets: (references, bytes, seconds). Every rank runs the
        export (a sharded trainer gathers collectively); rank 0's buckets are the ones published."""
        import ray

        from ..refit import buckets

        t0 = time.perf_counter()
        refs, nbytes = [], 0
        for bucket in buckets(self._exported(bucket_bytes, None), bucket_bytes):
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.rank == 0:
                refs.append(ray.put([(name, t.detach().cpu().contiguous()) for name, t in bucket]))
        return refs, nbytes, time.perf_counter() - t0

    def _exported(self, bucket_bytes: int, dtype: str | None):
        """The policy's (hf_name, tensor) stream. A sharded policy gathers it one `bucket_bytes` bucket at a time
        with its shards cast to `dtype` before gathering (`MegatronPolicy.export_weights`); a whole one has
        nothing to gather, and the weight group casts as it sends."""
        params = inspect.signature(self.policy.export_weights).parameters
        if "dtype" in params:
            return self.policy.export_weights(bucket_bytes, dtype)
        return self.policy.export_weights()

    def join_weights(self, host: str, port: int, world: int, timeout_s: float, backend: str,
                     senders: int = 1, shard: dict | None = None) -> None:
        """Rank 0: join a weight-update group as its first sender (hosting the rendezvous at `host:port`). A
        sharded policy announces the join, so each pipeline stage's sender joins too (`senders` of them)."""
        from ..distributed.weight_group import open_weight_group

        if self.rank != 0:
            raise RuntimeError("the driver joins the senders through trainer rank 0")
        if hasattr(self.policy, "join_weights"):
            self.policy.join_weights(host, port, world, timeout_s, backend, senders, None, shard)
        elif senders != 1:
            raise RuntimeError(f"a trainer of one stage cannot provide {senders} weight senders")
        else:
            self.weights = open_weight_group(host, port, 0, world, timeout_s, backend, shard=shard)

    def send_weights(self, bucket_bytes: int, dtype: str | None) -> tuple[int, float, object]:
        """Stream the policy and drafter to the weight-update group in packed `bucket_bytes` buckets, floating
        tensors in `dtype` (the engines' served dtype): (bytes of all senders, seconds, `transport.SendInfo`). A
        sharded trainer sends from one rank per pipeline stage (`MegatronPolicy.send_weights`); a whole one from
        here, its stream re-bucketed to `bucket_bytes`. A refit whose tensor set differs from the last one's (the
        policy's `refit_key`, the bucket size or the dtype) sends its headers again."""
        from ..refit import buckets
        from ..distributed.weight_group import dtype_of
        from .transport import SendInfo

        t0 = time.perf_counter()
        if hasattr(self.policy, "send_weights"):
            sent = self.policy.send_weights(bucket_bytes, dtype)
            info = SendInfo(len(sent["sender_bytes"]), max(sent["sender_bytes"]), max(sent["received_bytes"]),
                            max(sent["wait_s"]))
            nbytes = sum(sent["sender_bytes"])
        else:
            key = (bucket_bytes, dtype, self.policy.refit_key() if hasattr(self.policy, "refit_key") else None)
            nbytes = self.weights.send(buckets(self._exported(bucket_bytes, dtype), bucket_bytes),
                                       dtype_of(dtype) if dtype else None, key)
            info = SendInfo(1, nbytes, 0, self.weights.wait_s)
        self.crash.check("send_weights")
        return nbytes, time.perf_counter() - t0, info

    def state_dict(self) -> dict:
        return self.policy.state_dict()

    def save_sharded(self, out_dir: str, background: bool = False, writer: str = "process") -> dict:
        """Rank 0 of a Megatron trainer: every rank writes its own shards into `out_dir` (the followers take part
        through rank 0's announcement); returns the small state the run checkpoint keeps. `background`: each rank's
        shards are copied to host memory here and written by a thread of its actor (or a process: `writer`);
        `finish_save` completes them."""
        state = self.policy.save_sharded(out_dir, background=background, writer=writer)
        self.crash.check("save_sharded")
        return state

    def save_done(self) -> bool:
        """Rank 0: whether its background write has finished (`finish_save` then waits only for the others')."""
        return self.policy.save_done()

    def finish_save(self) -> float | None:
        """Rank 0: finalize the background save on every rank (collective, announced); its write's seconds."""
        return self.policy.finish_save()

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state)

    def arm_crash(self, method: str) -> None:
        self.crash.arm(method)


class DeviceProbe:
    """A momentary actor in one bundle: which GPU Ray gives that bundle, and on which node."""

    def device(self) -> tuple[str, str]:
        import ray

        ids = ray.get_gpu_ids()
        return str(ids[0]) if ids else "", ray.get_runtime_context().get_node_id()


def share_devices(devices: list[str] | None) -> None:
    """Point this process and the engine workers it starts (vLLM's processes inherit its environment) at
    `devices`, one GPU per worker in worker order: vLLM's worker of local rank w takes the w-th visible GPU, so it
    lands on `devices[w]`, the GPU of its bundle. None: Ray's own assignment stands. Before CUDA is initialised."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)


class Engine:
    """One generation engine (our engine or vLLM on its default executor, in this actor's process) and the policy
    version its weights are at. `devices`: the GPU of each of its workers (`share_devices`), None: Ray's."""

    def __init__(self, cfg, threads: int, index: int, devices: list[str] | None = None):
        import dataclasses

        import torch

        share_devices(devices)
        torch.set_num_threads(threads)
        # Files an engine writes under the run directory (vLLM's exported checkpoint) go to a directory of its own.
        run = dataclasses.replace(cfg.run, out_dir=f"{cfg.run.out_dir}/engines/{index}")
        self.generator = _build(dataclasses.replace(cfg, run=run), "generator")
        self.version = -1
        self.loaded = threading.Condition()  # notified when `version` changes (`wait_for`)
        self.in_flight = cfg.backend.in_flight_updates
        self.crash = CrashHook()

    def ready(self) -> int:
        """Answers once the engine is built (its version: -1 until the first sync)."""
        return self.version

    def update_weights(self, version: int, refs: list) -> tuple[int, float]:
        """The object-store fallback: load the buckets behind `refs` (policy and drafter: one version for both);
        returns (bytes, seconds)."""
        import ray

        t0 = time.perf_counter()
        nbytes = self._load(lambda: self.generator.update_weights(ray.get(ref) for ref in refs), version)
        return nbytes, time.perf_counter() - t0

    def _load(self, load, version: int) -> int:
        """Run `load()`, a refit of `version`, through the generator: between two decoding steps of a generation
        running in the actor's other thread (in-flight updates), at once when none runs."""
        refit = getattr(self.generator, "refit_in_flight", None)
        nbytes = refit(load, version) if refit else load()
        with self.loaded:
            self.version = version
            self.loaded.notify_all()
        return nbytes

    def wait_for(self, version: int) -> None:
        """With in-flight updates, hold a generation until the refit of `version` sent before it is in place: the
        refit runs in the actor's other concurrency group, so the generation could otherwise start first, with
        older weights than the driver counted on (a step's rollouts would then be more than `async_lag` old).
        Without them the actor runs calls in the order they were sent, so the refit is already in place."""
        if self.in_flight:
            with self.loaded:
                self.loaded.wait_for(lambda: self.version >= version)

    def weight_ranks(self) -> int:
        """Ranks this engine takes in a weight-update group: one per vLLM worker, one for our engine."""
        return getattr(self.generator, "workers", 1)

    def weight_shard(self) -> dict | None:
        """The geometry of this engine's sharded refit (`tp_cut`), None where its workers take whole tensors."""
        return getattr(self.generator, "shard", None)

    def join_weights(self, host: str, port: int, world: int, base_rank: int, timeout_s: float, backend: str,
                     senders: int = 1, shard: dict | None = None) -> str:
        """Join the weight-update group (its first `senders` members send) as ranks base_rank .. base_rank +
        weight_ranks() - 1; returns the dtype this engine serves (the senders cast to it)."""
        if hasattr(self.generator, "join_weight_group"):
            return self.generator.join_weight_group(host, port, world, base_rank, timeout_s, backend, senders, shard)
        from ..distributed.weight_group import open_weight_group

        self.weights = open_weight_group(host, port, base_rank, world, timeout_s, backend, senders=senders,
                                         shard=shard)
        return str(next(self.generator.model.parameters()).dtype).removeprefix("torch.")

    def receive_weights(self, version: int) -> tuple[int, float]:
        """Receive one refit from the weight-update group (the trainer streams it at the same time): policy and
        drafter, one version for both, taken between two generate calls, or with in-flight updates between two
        decoding steps of the one running. Returns (bytes, seconds)."""
        t0 = time.perf_counter()
        if hasattr(self.generator, "receive_weights"):  # vLLM: its workers receive
            nbytes = self._load(self.generator.receive_weights, version)
        else:  # our loader copies each bucket at once, so the receive buffers are reused
            nbytes = self._load(lambda: self.generator.update_weights(self.weights.receive(reuse=True)), version)
        self.crash.check("receive_weights")
        return nbytes, time.perf_counter() - t0

    def memory(self) -> dict:
        """This engine's peak resident memory since the last call (its actor process, and its vLLM worker
        processes as `children_peak_rss_mb`; CUDA peaks on GPUs), then a new peak starts (`memory`)."""
        from .. import memory

        return memory.step_memory()

    def wake(self) -> None:
        self.generator.wake()

    def sleep(self) -> None:
        self.generator.sleep()

    def supports_step_gate(self) -> bool:
        return self.generator.supports_step_gate

    def generate(self, prompts, params, colocated: bool, after: int = -1,
                 speculate: bool = True) -> tuple[list, float]:
        """Rollouts of `prompts`, each token's policy version in `Completion.versions` (filled in with the engine's
        version where the generator does not record it: it takes refits between generate calls only), and the
        seconds the generation took. `after`: the newest version sent before this call (`wait_for`); `speculate`
        False: the whole call without speculation (the generator's `speculation`, one mode per call). A colocated
        engine wakes for them and sleeps again after, leaving its devices to the trainer."""
        self.wait_for(after)
        t0, version = time.perf_counter(), self.version
        if colocated:
            self.generator.wake()
        with self.generator.speculation(speculate):
            outs = self.generator.generate(prompts, params)
        if colocated:
            self.generator.sleep()
        for out in outs:
            if not out.versions:
                out.versions = [version] * len(out.token_ids)
        self.crash.check("generate")
        return outs, time.perf_counter() - t0

    def arm_crash(self, method: str) -> None:
        self.crash.arm(method)

    def close(self) -> None:
        """Shut the engine down (a vLLM engine's own worker processes with it) before the actor is killed."""
        self.generator.close()
