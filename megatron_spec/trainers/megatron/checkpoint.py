"""Distributed checkpoints of `MegatronPolicy` (mixed into it), written in the foreground or in the background.

`save_sharded` / `load_sharded`: Megatron-Core's `dist_checkpointing` in its `torch_dist` format. Each rank writes its
own shards of the weights (the fp32 masters under bf16), of both Adam moments and of the MTP layers; nothing is
gathered. The optimizer's moments are saved as the model's own sharded state dict with the moment in place of each
weight, so they carry the same sharding metadata and reshard the same way: a run saved at one TP / PP / EP layout
loads at another. With `optimizer="megatron"` the checkpoint is Megatron-Core's own: the model's sharded state dict
and the distributed optimizer's `sharded_state_dict` of it in the `fully_reshardable` form (each weight's fp32 master
and moments in the weight's shape, keyed and sharded as the weight), which loads at another TP / PP / EP / DP
layout. The two forms do not load into each other. `state_dict` / `load_state_dict` (full HF-named tensors gathered
on every rank) stay for small models and tools (torch optimizer only).

A background save (`save_sharded(..., background=True)`) takes what Megatron-Core's own asynchronous save takes on the
critical path: the copy of this rank's shards to host memory (`snapshot`, since the next step updates the parameters
in place: into the writer process's shared buffer, or for the writer thread a clone of each host tensor, device
tensors then copied by Megatron's preload) and the collective planning. Megatron-Core's `AsyncCallsQueue` that would
then run the write needs CUDA, so a thread of ours runs it (`BackgroundWrite`: Megatron's per-file writer, in that
thread or handed to a spawned process, `writer.py`), and `finish_save` does the finalization Megatron defines (the
write results gathered, rank 0 writing the global metadata), collectively, when the loop asks. Until then the
directory is incomplete and not yet named as a checkpoint (`rl/checkpoint.py` renames it after).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_spec.rl.checkpoint import lower_priority
from megatron_spec.rl.config import ASYNC_SAVE_WRITERS

from . import require_megatron
from .cpu import on_cpu
from .exporter import export_hf
from .importer import import_hf
from .writer import whole_storage, in_this_thread, writer_process

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402

OPT_STATES = ("exp_avg", "exp_avg_sq")
MEGATRON_CKPT = dict(distrib_optim_sharding_type="fully_reshardable", chained_optim_avoid_prefix=True)
"""Megatron-Core's checkpoint metadata: the distributed optimizer's state in the model's space (each weight's fp32
master and Adam moments shaped and sharded as the weight, so it loads at any TP / PP / EP / DP layout; to save or
load it every rank holds its model-parallel part's whole states in host memory for a moment, gathered over data
parallel), and the same tensor keys whatever the optimizer chain. (Megatron's per-rank `fully_sharded_model_space`
form is refused by megatron-core 0.16's own checks: its flattened ranges are no longer supported.)"""


class BackgroundWrite:
    """One rank's part of a background save: Megatron-Core's `AsyncRequest` written by a thread (its staging
    `preload_fn` first, in the caller's thread), finalized by `finish`."""

    def __init__(self, request, writer=None):
        self.request = request
        self.writer = writer or in_this_thread  # or a `writer.WriterProcess`, called the same way
        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # device -> host copies; host tensors were cloned by `snapshot`
            args[1] = request.preload_fn()
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._write, args=(args,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def _write(self, args) -> None:
        t0 = time.perf_counter()
        lower_priority()
        try:
            fn = self.request.async_fn
            if getattr(getattr(fn, "func", None), "__name__", "") == "write_preloaded_data_multiproc":
                self.writer(*fn.args, *args)
            elif fn is not None:  # None: nothing of this rank's to write
                fn(*args, **self.request.async_fn_kwargs)
        except BaseException as err:  # noqa: BLE001  (re-raised in the caller's thread by `finish`)
            self.error = err
        self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self.thread.is_alive()

    def finish(self) -> float:
        """Collective, on success and failure alike: a rank whose write failed still takes part in Megatron's
        finalization, which gathers every rank's results and raises on all of them (a rank raising alone would
        leave the others waiting in the gather)."""
        self.thread.join()
        if self.request.async_fn is not None and self.error is None:
            # The writer hands its results over through a multiprocessing queue whose feeder thread may still be
            # flushing when the writer returns; Megatron's finalization reads it without waiting.
            results = self.request.async_fn_args[2]
            deadline = time.monotonic() + 60
            while results is not None and results.empty() and time.monotonic() < deadline:
                time.sleep(0.005)
        # Collective: the write results gathered (an empty queue counts as this rank's failure), the metadata
        # written by rank 0 only if no rank failed. Megatron raises torch's CheckpointException, a BaseException
        # that callers catching Exception (Ray's actors, the loop) would not see as an error: raised as one.
        try:
            for fn in self.request.finalize_fns:
                fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001
            raise RuntimeError(f"background checkpoint write failed: {err}") from err
        if self.error is not None:  # a failure Megatron's results did not carry (there was nothing to write)
            raise RuntimeError(f"background checkpoint write failed: {self.error}") from self.error
        return self.seconds


class ShardedCheckpoints:
    """The checkpoint methods of `MegatronPolicy` (it provides `model`, `chunks`, `par`, `eagle3`, `_announce`,
    its `optimizer` (`optimizer.ShardOptimizer`) and that optimizer's `masters`, `opt` and `mopt`)."""

    _pending_save: BackgroundWrite | None = None


    @contextlib.contextmanager
    def _params_as(self, key: str, create: bool = False):
        """Each parameter's data temporarily replaced by its Adam state `key` (zeros before the first step; kept
        when `create`), so the exporter and importer map the optimizer state exactly as they map the weights
        (names, shards, experts, stages)."""
        params = list(self.masters)
        saved = [p.data for p in params]
        for p in params:
            master = self.masters[p]
            if key == "master":
                value = master.data
            else:
                value = self.opt.state.get(master, {}).get(key)
                if value is None:
                    value = torch.zeros_like(master)
                    if create:
                        self.opt.state[master][key] = value
            p.data = value
        try:
            yield
        finally:
            for p, d in zip(params, saved):
                p.data = d

    def state_dict(self) -> dict:
        """Full HF-named weights and Adam moments (layout-independent), the Adam step and the learning rates."""
        self.optimizer.torch_only("state_dict")
        self._announce("state_dict")
        with self._params_as("master"):
            state = {"weights": {n: t.cpu().clone() for n, t in export_hf(self.chunks)}}
        for key in OPT_STATES:
            with self._params_as(key):
                state[key] = {n: t.cpu().clone() for n, t in export_hf(self.chunks)}
        state["step"] = self.optimizer.adam_step()
        state["layout"] = self.par.describe()
        if self.eagle3:
            state[self.eagle3.state_key] = self.eagle3.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Every rank imports its shards of the weights and Adam moments saved at any layout."""
        if "sharded_dir" in state:  # a run checkpoint of `save_sharded`
            self.load_sharded(state["sharded_dir"], state)
            return
        self.optimizer.torch_only("load_state_dict")
        self._announce("load_state_dict", state)
        with self._params_as("master"):
            import_hf(self.chunks, state["weights"])
        self.optimizer.masters_to_params()
        for key in OPT_STATES:
            with self._params_as(key, create=True):
                import_hf(self.chunks, state[key])
        self._set_step(state["step"])
        if self.eagle3 and self.eagle3.state_key in state:
            self.eagle3.load_state_dict(state[self.eagle3.state_key])

    def _set_step(self, step: float) -> None:
        for group in self.opt.param_groups:
            for p in group["params"]:
                self.opt.state[p]["step"] = torch.tensor(step)

    # -- distributed checkpoints ------------------------------------------------------------------------------

    def _sharded(self, key: str) -> dict:
        """The model's sharded state dict under `key.` with `key`'s tensors (fp32 masters, an Adam moment) in
        place of the weights, detached from the parameters so the swap can be undone before it is written. With
        virtual pipeline stages each chunk's under `{key}.chunk{v}` (`_chunk_dicts`): the tensors' checkpoint keys
        and offsets are global (layer numbers across the whole model), so the files are those of one chunk per
        stage and load at any vp."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        with self._params_as("master" if key == "weights" else key, create=True):
            # The metadata Megatron's training loop passes (the PP stage holding MTP layers ties its embedding copy).
            metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
            sd = {k: c.sharded_state_dict(prefix=f"{key}.", metadata=metadata) for k, c in self._chunk_dicts(key)}
            if len(self.chunks) == 1:
                sd = sd[key]

            def detach(d):
                for k, v in list(d.items()):
                    if isinstance(v, dict):
                        detach(v)
                    elif isinstance(v, ShardedObject):
                        if key != "weights":  # module extra state once, with the weights
                            del d[k]
                    elif hasattr(v, "data") and isinstance(v.data, torch.Tensor):
                        v.data = v.data.detach()
            detach(sd)
        return sd

    def _chunk_dicts(self, key: str) -> list[tuple[str, object]]:
        """(where `_sharded` puts each chunk's state dict, the chunk): `key` itself for one chunk."""
        if len(self.chunks) == 1:
            return [(key, self.chunks[0])]
        return [(f"{key}.chunk{v}", c) for v, c in enumerate(self.chunks)]

    def _megatron_sharded(self, is_loading: bool) -> dict:
        """Megatron-Core's checkpoint of the model and its distributed optimizer, as its training loop builds it:
        the model's sharded state dict (the weights themselves, so the optimizer finds each one's shards) and the
        optimizer's `sharded_state_dict` of it (`MEGATRON_CKPT`)."""
        from megatron.core.optimizer import distrib_optimizer

        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True), **MEGATRON_CKPT}
        model = self.model.sharded_state_dict(prefix="", metadata=metadata)
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE:
            # torch's Adam (no TE / Apex) keeps its step per parameter, and building the state dict to load into
            # reads it: a fresh optimizer first takes Megatron's own zero-gradient step (its update is 0; the load
            # overwrites states and step). TE's and Apex's FusedAdam keep the step per group and need none.
            for sub in self.optimizer.subs():
                inner = None if getattr(sub, "is_stub_optimizer", False) else getattr(sub, "optimizer", None)
                if inner is not None and len(inner.state) == 0:
                    sub._init_optimizer_states_with_dummy_values()
        return {"model": model, "optimizer": self.mopt.sharded_state_dict(model, is_loading, metadata=metadata)}

    def save_sharded(self, out_dir: str | os.PathLike | None, background: bool = False,
                     writer: str = "process") -> dict:
        """Every rank writes its own shards of the weights (fp32 masters), both Adam moments and the MTP layers
        into `out_dir` (Megatron-Core `torch_dist`; rank 0's `out_dir` counts, the others may pass None). Collective;
        returns the small state the run checkpoint keeps beside it (`load_state_dict` of it loads the shards).
        With `optimizer="megatron"`: Megatron-Core's checkpoint of the model and the distributed optimizer
        (`_megatron_sharded`); ranks holding a data-parallel replica of a shard leave its writing to the first.

        `background`: the shards are copied to host memory and planned here, written while training goes on; the
        checkpoint is complete only after `finish_save` (collective), and one save is in flight at a time.
        `writer`: what writes it, a spawned process (`writer.py`) or a thread of this process."""
        from megatron.core import dist_checkpointing

        if self._pending_save is not None:
            raise RuntimeError("a background save is still in flight: finish_save() it before the next save")
        if writer not in ASYNC_SAVE_WRITERS:
            raise ValueError(f"checkpoint writer {writer!r}: one of {', '.join(ASYNC_SAVE_WRITERS)}")
        self._announce("save_sharded", None if out_dir is None else str(out_dir), background, writer)
        box = [None if out_dir is None else str(out_dir)]
        dist.broadcast_object_list(box, src=0)  # rank 0 names the directory (a temporary one, renamed after)
        out_dir = Path(box[0])
        if dist.get_rank() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.mopt is not None:
            sd = self._megatron_sharded(is_loading=False)
        else:
            sd = {k: v for key in ("weights", *OPT_STATES) for k, v in self._sharded(key).items()}
        step = self.optimizer.adam_step()
        if background:
            process = writer_process() if writer == "process" else None
            if not snapshot(sd, process.snapshot if process else None):
                process = None  # no room in /dev/shm: the thread writes this save
            with on_cpu():
                request = dist_checkpointing.save(sd, str(out_dir), async_sharded_save=True)
                self._pending_save = BackgroundWrite(request, process)
        else:
            unviewed(sd)
            with on_cpu():
                dist_checkpointing.save(sd, str(out_dir))
            dist.barrier()  # every rank's files are on disk before the caller renames the directory into place
        out = {"sharded_dir": out_dir.name, "step": step, "layout": self.par.describe(),
               "optimizer": self.optimizer.kind}
        if self.eagle3:  # small and replicated: kept beside the shards
            out[self.eagle3.state_key] = self.eagle3.state_dict()
        return out

    def save_done(self) -> bool:
        """Whether this rank's background write (if any) has finished writing (`finish_save` then blocks only on
        the other ranks'). Not collective."""
        return self._pending_save is None or self._pending_save.done()

    def finish_save(self) -> float | None:
        """Wait for the background save's files on every rank, then finalize it (Megatron-Core's global metadata,
        written by rank 0 once all ranks report their files). Collective. Returns the seconds the write took on
        this rank, None when no save was in flight."""
        self._announce("finish_save")
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return None
        with on_cpu():
            seconds = pending.finish()
        dist.barrier()  # every rank's files and the metadata are on disk before the caller renames the directory
        return seconds

    def load_sharded(self, ckpt_dir: str | os.PathLike, state: dict | None = None) -> None:
        """Every rank reads its own shards of a `save_sharded` checkpoint made at any TP / PP / EP layout (and,
        with `optimizer="megatron"`, data-parallel size) by a policy with the same `optimizer`."""
        from megatron.core import dist_checkpointing

        saved_by = (state or {}).get("optimizer", "torch")
        if saved_by != self.optimizer.kind:
            raise ValueError(f"checkpoint {ckpt_dir} holds optimizer={saved_by} state; this policy has "
                             f"backend.megatron.optimizer={self.optimizer.kind}")
        self._announce("load_sharded", str(ckpt_dir), state)
        if self.mopt is not None:
            self._load_megatron(ckpt_dir)
            if self.eagle3 and state and self.eagle3.state_key in state:
                self.eagle3.load_state_dict(state[self.eagle3.state_key])
            return
        for key in ("weights", *OPT_STATES):
            sd = self._sharded(key)
            with on_cpu():
                loaded = dist_checkpointing.load(sd, str(ckpt_dir))
            missing = []
            for where, chunk in self._chunk_dicts(key):
                values = loaded if len(self.chunks) == 1 else loaded[where]
                values = {k[len(key) + 1 :]: v for k, v in values.items()}
                with self._params_as("master" if key == "weights" else key, create=True):
                    missing += chunk.load_state_dict(values, strict=False)[0]
            missing = [n for n in missing if not n.endswith("_extra_state")]
            if missing:
                raise ValueError(f"checkpoint {ckpt_dir} has no {key} for {len(missing)} parameter(s), "
                                 f"e.g. {missing[:3]}")
        self.optimizer.masters_to_params()
        self._set_step((state or {}).get("step", 0.0))
        if self.eagle3 and state and self.eagle3.state_key in state:
            self.eagle3.load_state_dict(state[self.eagle3.state_key])

    def _load_megatron(self, ckpt_dir: str | os.PathLike) -> None:
        """The model's weights, then the distributed optimizer's fp32 masters, moments, step and groups, from
        `_megatron_sharded`'s checkpoint, as Megatron-Core's training loop loads them."""
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._megatron_sharded(is_loading=True), str(ckpt_dir))
        missing, _ = self.model.load_state_dict(loaded["model"], strict=False)
        missing = [n for n in missing if not n.endswith("_extra_state")]
        if missing:
            raise ValueError(f"checkpoint {ckpt_dir} has no weights for {len(missing)} parameter(s), "
                             f"e.g. {missing[:3]}")
        self.mopt.load_state_dict(loaded["optimizer"])


def unviewed(sharded: dict) -> None:
    """Build the sharded state dict's factories and hand every tensor to the writer as `whole_storage`, in place.

    Megatron-Core's `torch_dist` writer clones, before writing anything, every host tensor that is a view into a
    larger storage; the gate and up halves of each SwiGLU weight (and of its Adam moments) are such views, so a save
    held a second copy of two thirds of every MLP's state."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)

    def fix(x):
        if isinstance(x, ShardedTensor) and isinstance(x.data, torch.Tensor):
            x.data = whole_storage(x.data)
        return x

    dict_list_map_inplace(fix, sharded)


def snapshot(sharded: dict, into=None) -> bool:
    """Build the sharded state dict's factories and replace every host tensor by a copy of its own, in place: what
    a background write reads must not change while the next step updates the parameters and moments. (Device
    tensors are left to Megatron's preload, which copies them to the host.)

    `into`: a `writer.SharedSnapshot` whose shared buffer takes the copies of every tensor, device tensors
    included, for a writer process; returns False (the copies made as without it) where /dev/shm has no room for
    them, with a line saying so."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    host = []

    def collect(x):
        if isinstance(x, ShardedTensor) and isinstance(x.data, torch.Tensor):
            host.append(x)
        return x

    dict_list_map_inplace(collect, sharded)
    if into is not None:
        fits, need, free = into.fits([x.data for x in host])
        if fits:
            for x, t in zip(host, into.take([x.data for x in host])):
                x.data = t
            return True
        print(f"checkpoint writer process: the copy needs {need / 2**30:.1f} GiB of /dev/shm, {free / 2**30:.1f} GiB "
              "free; this save is written by a thread (enlarge /dev/shm, e.g. docker --shm-size, or set "
              "run.async_save_writer=thread)", flush=True)
    for x in host:
        if x.data.device.type == "cpu":
            x.data = x.data.detach().clone(memory_format=torch.contiguous_format)
    return into is None
