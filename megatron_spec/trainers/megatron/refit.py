"""The refit side of `MegatronPolicy` (mixed into it): its weights as the engines load them, either streamed to the
loop on rank 0 (`export_weights`) or sent by each pipeline stage into the engines' weight-update group
(`join_weights`, then `send_weights` every refit). The buckets come from `refit_stream`; the names the engines give
the drafters' tensors from the policy's `_for_engines`.
"""

from __future__ import annotations

import torch.distributed as dist


class RefitSource:
    """The refit methods of `MegatronPolicy` (it provides `chunks`, `eagle3`, `_announce` and `_for_engines`)."""

    def export_weights(self, bucket_bytes: int | None = None, dtype: str | None = None):
        """(hf_name, full tensor) of the policy, then the MTP layers as the generator's drafter (`drafter.mtp.*`),
        gathered one refit bucket at a time (`bucket_bytes`, default the loop's refit bucket), floating shards cast
        to `dtype` (the engines' dtype name; None: as trained) before they are gathered (`refit_stream`).
        Collective: the caller must drain the iterator (the loop's refit does)."""
        from megatron_spec.rl.loop import REFIT_BUCKET_BYTES

        from ...distributed.weight_group import dtype_of
        from .refit_stream import refit_buckets

        bucket_bytes = bucket_bytes or REFIT_BUCKET_BYTES
        self._announce("export_weights", bucket_bytes, dtype)
        stream = refit_buckets(self.chunks, bucket_bytes, dtype_of(dtype) if dtype else None)
        yield from self._for_engines((item for bucket in stream for item in bucket), eagle3=True)

    def join_weights(self, host: str, port: int, world: int, timeout_s: float, backend: str, senders: int,
                     paired: bool | None = None, shard: dict | None = None) -> None:
        """Join the weight-update group at `host:port` (rank 0 hosts it) as one sender per pipeline stage, the
        stage's first rank, or, `paired` (None: the CUDA IPC refit's rule, `refit_stream.per_gpu`), as ranks
        0 .. senders - 1, each serving the engine worker on its GPU (`refit_stream.join_stage_sender`); the other
        ranks only gather. `shard`: the group's sharded mode (each sender cuts every tensor per engine TP rank,
        `weight_group.WeightGroup`). Collective."""
        from .refit_stream import join_stage_sender, per_gpu

        self._announce("join_weights", host, port, world, timeout_s, backend, senders, paired, shard)
        self.weight_group = join_stage_sender(host, port, world, timeout_s, backend, senders, paired, shard)
        self.refit_per_gpu = per_gpu(backend) if paired is None else paired

    def send_weights(self, bucket_bytes: int, dtype: str | None) -> dict:
        """One refit into the joined weight-update group: each pipeline stage gathers only its own buckets and its
        sender sends them (stage 0's also the EAGLE-3 head), or, per GPU (CUDA IPC), every sender the whole model
        and the head; the senders' bytes and waits and every rank's
        received bytes (`refit_stream.send_stages`). Collective."""
        from ...distributed.weight_group import dtype_of
        from .refit_stream import refit_buckets, send_stages, stage_buckets

        self._announce("send_weights", bucket_bytes, dtype)
        cast, received = dtype_of(dtype) if dtype else None, [0]
        whole = getattr(self, "refit_per_gpu", False)  # every sender the whole model, to the worker on its GPU
        stream = (refit_buckets if whole else stage_buckets)(self.chunks, bucket_bytes, cast, received)
        group = getattr(self, "weight_group", None)
        if group is None and dist.get_rank() == 0:
            raise RuntimeError("send_weights before join_weights: the weight-update group is not formed")
        if self.eagle3:  # shared on every rank first: a stage's sender blocked on it mid-stream would hold its
            self.eagle3.share()  # receivers, and they the other stages' senders
        named = self._for_engines((item for bucket in stream for item in bucket), eagle3=group is not None and
                                  (whole or group.rank == 0), shared=True)
        return send_stages(group, named, received, bucket_bytes, cast, (bucket_bytes, dtype, whole, self.refit_key()))

    def refit_key(self) -> tuple:
        """The exported tensor set (`refit.tensor_set_key`): this rank's model chunks (MTP layers in them), whether
        they go to the engines as a drafter, and the EAGLE-3 head's module."""
        from ...refit import tensor_set_key

        head = getattr(self.eagle3, "head", None) if self.eagle3 else None
        return (self.has_drafter, bool(self.eagle3), tensor_set_key(*self.chunks, head))
