"""The weight-update group: torch.distributed process groups of their own (never the default group, so they never
disturb the trainer's or vLLM's) from the trainer ranks that send (one per pipeline stage, each holding only its
own stage's weights) to every generator worker.

Members `0 .. senders - 1` send, the rest receive. Each sender has a process group of its own with every receiver
(the sender its rank 0), so no sender ever receives another sender's bytes; receivers take the senders' refits at
once, a bucket of each in turn (sender order, the same on every receiver), so every stage streams while the others
do. A `paired` group instead gives each sender one receiver, member `senders + s`
taking sender s's whole stream only (the per-GPU CUDA IPC refit: each sender serves the engine worker on its GPU).
A `shard`ed group (engines of vLLM tensor parallel size N > 1, N receivers each) gives each sender N groups instead,
group r = {sender, worker r of every engine}: the sender cuts each tensor as vLLM's loader does for TP rank r
(`tp_cut.cut`; tensors vLLM replicates go whole to every group) and sends rank r's pieces into group r, so a
worker's link carries about 1/N of the model. Each piece's header entry adds the full shape, the cut dim and the
offset; the receiver hands its loader a transient full-shaped tensor holding the piece in its place (the loader
narrows to exactly that part). A sender's groups take the frames of each bucket in turn (group 0's, group 1's,
...), FRAMED or PACKED alike.
Per sender (and group) and refit:

    control          [FRAMED or PACKED, buckets]                       one small all-reduce
    FRAMED:          per bucket [header bytes, payload bytes], the JSON header, the payload; then [END | ABORT]
    PACKED:          per bucket only the payload; then [END | ABORT]

The header lists each tensor's name, dtype, shape and byte offset; the payload is the bucket's tensors, cast to
the dtype the engines serve, packed end to end (offsets aligned to 16 bytes, so every view is aligned). A model's
layout rarely changes between refits, so the first refit of a group is FRAMED and both sides keep its headers:
every later one is PACKED (metadata once, then none), with no per-bucket size, header or host sync, until the
sender's `key` (what its caller says determines the tensor set: names, drafter, bucket size, dtype) changes; that
refit is FRAMED again, its headers replacing the old on both sides (a drafter added or removed, a new layout). A
receiver cannot tell a payload from another without its header, so the change must be known before the refit
opens: a PACKED refit whose buckets turn out to differ from the layout aborts (below) instead of loading them. The
sender packs bucket n + 1 into one of two payload buffers while bucket n's broadcast (asynchronous) is in flight;
receivers post bucket n + 1's receive before handing bucket n to the loader, each into a fresh buffer (vLLM's
layer-wise reload keeps the views it is given until a layer is complete). A sender that fails mid-stream still
completes the broadcasts the receivers expect (with zeros), then sends ABORT, on which the receivers raise.

Nothing is written to a file or put in an object store. gloo carries host tensors, NCCL device tensors
(`collective_device`); a tensor on the wrong device for the group's backend is refused before the collective. Used
by the Ray trainer and engine actors and by the vLLM worker extension (each vLLM worker is a receiver), so an
engine of tensor parallel size N is N receivers. Every member is made by `open_weight_group`, which maps the
transport's name to the class that carries it (`GROUPS`).

CUDA IPC (`CudaIpcWeightGroup`), for trainer ranks and engine workers that share GPUs (colocated placement), so
that a bucket need not move: a paired group, sender s and receiver s on one GPU, always FRAMED, the body being the
CUDA IPC handle of one device buffer

    sender:     cast the bucket into one device buffer -> broadcast [header bytes, handle bytes] -> header -> the
                buffer's CUDA IPC handle -> wait until every receiver acknowledges -> free the buffer
    receivers:  open the handle (a view of the sender's memory, no copy), hand the bucket to the loader, which
                copies it into the engine's weights on the same GPU, then acknowledge

Its group is a gloo group carrying only headers, handles and acknowledgements, so the weights cross no host memory
and no network; the acknowledgement keeps the sender from freeing a buffer a receiver is still reading. A handle
only opens in another process on the same physical GPU: the placement decides when it applies.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from .process_groups import collective_backend, collective_device, local_device, rendezvous

END, ABORT = -1, -2
"""Closing marks of a sender's refit: complete; the sender failed mid-stream (the receivers raise)."""
FRAMED, PACKED = -3, -4
"""Opening marks: buckets with their headers (the layout is learnt); payloads only (the layout is known)."""
_ALIGN = 16


class RefitAborted(RuntimeError):
    """The sender failed while streaming; what the receivers loaded of this refit is incomplete."""


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight group: unknown dtype {name!r}")
    return dtype


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layout_of(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
              cuts: list | None = None) -> tuple[list, int]:
    """A bucket's header ([name, dtype, shape, offset] per tensor, floating tensors in `dtype`; a tensor that is a
    piece of a larger one, `cuts[i]` = [full shape, dim, start], carries those three too) and payload bytes (the
    tensors' bytes with the alignment padding between them)."""
    header, offset = [], 0
    for i, (name, t) in enumerate(bucket):
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        header.append([name, str(dt), list(t.shape), offset, *(cuts[i] if cuts and cuts[i] else ())])
        offset += -(-t.numel() * _size(dt) // _ALIGN) * _ALIGN
    return header, offset


def tensor_bytes(header: list) -> int:
    """The bytes of a bucket's tensors (what a refit reports: padding is not counted)."""
    return sum(torch.Size(entry[2]).numel() * _size(dtype_of(entry[1])) for entry in header)


def bucket_views(header: list, payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Split a received payload back into (hf_name, tensor) views, as its header lays them out; a piece of a larger
    tensor comes back as a tensor of the full shape holding the piece in its place (`tp_cut.rebuild`: the loader
    narrows to exactly that part, the rest is never read)."""
    from ..tp_cut import rebuild

    out = []
    for name, dtype, shape, offset, *cut in header:
        dt = dtype_of(dtype)
        n = torch.Size(shape).numel() * _size(dt)
        view = payload[offset:offset + n].view(dt).view(shape)
        out.append((name, rebuild(cut[0], cut[1], cut[2], view) if cut else view))
    return out


def _geometry(shard: dict | None, paired: bool, receivers: int):
    """The sharded mode's `tp_cut.Geometry` (None: whole tensors to every receiver). Each sender then has one
    process group per TP rank r, {sender, worker r of every engine}: the receivers are engines of `tp` workers
    each, numbered engine by engine."""
    if not shard or shard.get("tp", 1) <= 1:
        return None
    from ..tp_cut import Geometry

    geo = Geometry(**shard)
    if paired:
        raise ValueError("weight group: a paired group (one receiver per sender) cannot also be sharded")
    if receivers % geo.tp:
        raise ValueError(f"weight group: {receivers} receivers are not engines of TP {geo.tp} (sharded refit)")
    return geo


class WeightGroup:
    """Member `rank` of a weight-update group of `world` members, the first `senders` of them senders, rendezvousing
    at `host:port` (member 0 hosts it). `backend`: gloo or nccl (None: nccl where there is a GPU); `timeout_s`
    bounds the start-up and each collective. `shard`: `tp_cut.Geometry` fields of the engines (every engine of
    TP `tp` > 1), for the sharded mode: each worker receives only the part of each tensor vLLM's loader keeps on
    its TP rank (`tp_cut.cut`), tensors vLLM replicates whole."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, backend: str | None = None,
                 local_rank: int = 0, senders: int = 1, paired: bool = False, shard: dict | None = None):
        if not 0 < senders <= world or not 0 <= rank < world:
            raise ValueError(f"weight group: member {rank} of {world} with {senders} sender(s): needs 1 <= senders "
                             "<= world and 0 <= rank < world")
        if paired and world != 2 * senders:
            raise ValueError(f"weight group: paired, each of the {senders} sender(s) serves one receiver, so the "
                             f"group has {2 * senders} members, not {world}")
        self.geometry = _geometry(shard, paired, world - senders)
        tp = self.geometry.tp if self.geometry else 1
        self.rank, self.world, self.senders, self.paired = rank, world, senders, paired
        self.backend = backend or collective_backend()
        self.device = collective_device(self.backend, local_rank)
        self.store = rendezvous(host, port, rank, world, timeout_s, "weight-update group")
        self.timeout = timedelta(seconds=timeout_s)
        size = 2 if paired else 1 + (world - senders) // tp  # a sender and the receivers it serves (per TP rank)
        if rank < senders:
            self.pgs = ([self._group(f"{rank}/{r}", 0, size) for r in range(tp)] if self.geometry
                        else [self._group(rank, 0, size)])
            self.pg = self.pgs[0]
        elif paired:  # receiver senders + s takes sender s's stream only
            self.pg = None
            self.pgs = [self._group(rank - senders, 1, size)]
        elif self.geometry:  # worker r of engine e: TP rank r's pieces, from every sender's group r
            self.pg = None
            e, r = divmod(rank - senders, tp)
            self.pgs = [self._group(f"{s}/{r}", 1 + e, size) for s in range(senders)]
        else:
            self.pg = None
            self.pgs = [self._group(s, 1 + rank - senders, size) for s in range(senders)]
        self.layouts: list[list | None] = [None] * len(self.pgs)  # per sender: [(header, bytes)] per bucket
        self._buffers: list[torch.Tensor] = []

    def _group(self, sender, rank: int, size: int):
        import torch.distributed as dist

        store = dist.PrefixStore(f"megatron_spec/weights/{sender}", self.store)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, size, self.timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    @property
    def is_sender(self) -> bool:
        return self.rank < self.senders

    def _post(self, tensor: torch.Tensor, pg=None):
        """Start a broadcast from the sender of `pg` (default: this sender's group); returns its work."""
        import torch.distributed as dist

        if tensor.device != self.device:
            raise RuntimeError(f"weight group ({self.backend}): a tensor on {tensor.device} where {self.device} is "
                               "needed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return (pg or self.pg).broadcast([tensor], opts)

    def _broadcast(self, tensor: torch.Tensor, pg=None) -> None:
        self._post(tensor, pg).wait()

    def _mark(self, a: int, b: int = 0, pg=None) -> tuple[int, int]:
        t = torch.tensor([a, b], dtype=torch.int64, device=self.device)
        self._broadcast(t, pg)
        return tuple(t.tolist())

    def _open(self, mode: int, n: int, pg=None) -> tuple[int, int]:
        """The opening mark as an all-reduce (receivers add zeros), so it completes only once every member has
        arrived: the sender's time in it is its wait for the engines (`wait_s`), which a broadcast, buffered by
        the transport, would not show."""
        import torch.distributed as dist

        t = torch.tensor([mode, n], dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        (pg or self.pg).allreduce([t], dist.AllreduceOptions()).wait()
        self.wait_s = time.perf_counter() - t0
        return tuple(t.tolist())

    # -- sending ------------------------------------------------------------------------------------------------

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], dtype: torch.dtype | None = None,
             key=None) -> int:
        """A sender: stream `buckets` to every receiver, floating tensors cast to `dtype` (None: as they are);
        returns the tensors' bytes sent (in the sent dtype). `key`: a comparable description of the tensor set the
        buckets hold, given before they are made; a key other than the last refit's sends the headers again
        (FRAMED). The sender holds the bucket it is given plus two payloads; `wait_s` is then how long it waited
        for the receivers to arrive."""
        if not self.is_sender:
            raise RuntimeError(f"weight group: member {self.rank} receives (members 0..{self.senders - 1} send)")
        if self.layouts[0] is None or not self.packs or key != self.key:
            total = self._send_framed(buckets, dtype)
            self.key = key
            return total
        return self._send_packed(buckets, dtype)

    key = None
    """The tensor-set key of the layout the receivers hold (`send`)."""

    packs = True
    """Whether refits after the first travel PACKED (CUDA IPC sends a handle per bucket instead)."""

    def _payload(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(0, dtype=torch.uint8, device=self.device)  # freed before the new one
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot][:nbytes]

    @torch.no_grad()
    def _pack(self, bucket, header: list, out: torch.Tensor) -> torch.Tensor:
        for (_, t), (_, dt, shape, offset, *_) in zip(bucket, header):
            dt = dtype_of(dt)
            out[offset:offset + t.numel() * _size(dt)].view(dt).view(shape).copy_(t.detach())  # cast and copy
        return out

    def _frames(self, buckets, dtype):
        """Each bucket as what each of this sender's groups gets of it: (group, tensors, header, payload bytes);
        in the sharded mode one frame per TP rank, its tensors that rank's pieces (`tp_cut.cut`, views) and the
        replicated tensors whole."""
        from ..tp_cut import cut

        for bucket in buckets:
            if self.geometry is None:
                frames = [(self.pg, bucket, *layout_of(bucket, dtype))]
            else:
                frames = []
                for r, pg in enumerate(self.pgs):
                    part, cuts = [], []
                    for name, t in bucket:
                        c = cut(name, tuple(t.shape), self.geometry, r)
                        part.append((name, t if c is None else t.narrow(*c)))
                        cuts.append(None if c is None else [list(t.shape), c[0], c[1]])
                    frames.append((pg, part, *layout_of(part, dtype, cuts)))
                del part
            del bucket  # not held while the next one is made (its frames are, until sent)
            while frames:
                yield frames.pop(0)

    def _open_all(self, mode: int, n: int) -> None:
        """Open the refit in each of this sender's groups; `wait_s` is the total wait for the receivers."""
        wait = 0.0
        for pg in self.pgs:
            self._open(mode, n, pg)
            wait += self.wait_s
        self.wait_s = wait

    def _send_framed(self, buckets, dtype) -> int:
        layout, total = [], 0
        self._open_all(FRAMED, 0)
        try:
            for pg, part, header, n in self._frames(buckets, dtype):
                total += self._send_bucket(part, header, n, pg)
                layout.append((header, n))
                del part
        except BaseException:
            for pg in self.pgs:
                self._mark(ABORT, pg=pg)
            raise
        finally:
            self._buffers = []
        for pg in self.pgs:
            self._mark(END, pg=pg)
        self.layouts[0] = layout
        return total

    def _send_bucket(self, bucket, header: list, nbytes: int, pg=None) -> int:
        """One FRAMED bucket: sizes, the JSON header, then the packed payload. Returns its tensors' bytes."""
        payload = self._pack(bucket, header, self._payload(0, nbytes))
        head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(self.device)
        self._mark(head.numel(), nbytes, pg)
        self._broadcast(head, pg)
        self._broadcast(payload, pg)
        return tensor_bytes(header)

    def _send_packed(self, buckets, dtype) -> int:
        """The layout's frames go to the groups in turn (frame i to group i mod groups, as `_frames` made them)."""
        layout, total, sent = self.layouts[0], 0, 0
        works = [None, None]

        def post(i: int, fill=None) -> torch.Tensor:
            slot = i % 2
            if works[slot] is not None:
                works[slot].wait()  # the broadcast of frame i - 2 has left this buffer
            buf = self._payload(slot, max(n for _, n in layout))[:layout[i][1]]
            if fill is None:
                buf.zero_()
            else:
                self._pack(fill, layout[i][0], buf)
            works[slot] = self._post(buf, self.pgs[i % len(self.pgs)])
            return buf

        self._open_all(PACKED, len(layout) // len(self.pgs))
        mark = ABORT
        try:
            for _, part, header, n in self._frames(buckets, dtype):
                if sent >= len(layout) or [header, n] != list(layout[sent]):
                    raise RuntimeError(f"weight group: bucket {sent} of this refit differs from the layout the last "
                                       "framed refit sent (the exported tensors, bucket size or dtype changed while "
                                       "the sender's key stayed the same)")
                post(sent, part)
                total, sent = total + tensor_bytes(header), sent + 1
                del part
            if sent != len(layout):
                raise RuntimeError(f"weight group: {sent} buckets where the layout has {len(layout)}")
            mark = END
        finally:
            if mark == ABORT:  # complete what the receivers wait for, so they reach the mark
                self.layouts[0] = None  # the next refit sends its headers again
                for i in range(sent, len(layout)):
                    post(i)
            for w in works:
                if w is not None:
                    w.wait()
            for pg in self.pgs:
                self._mark(mark, pg=pg)
        return total

    # -- receiving ----------------------------------------------------------------------------------------------

    def receive(self, reuse: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """A receiver: every sender's buckets, each a list of (hf_name, tensor) views of one received buffer. The
        senders are taken at once, one bucket of each in turn (sender order), so every stage streams its share
        while the others do: a receiver's link, not one sender's, bounds the refit. `reuse`: for a loader that
        copies each bucket before asking for the next, two buffers per sender alternate (no allocation or first
        touch of fresh memory per bucket); otherwise each bucket is a fresh buffer (vLLM's reload keeps views until
        a layer is whole). Must be drained to the end; the bytes received are `self.received` after."""
        if self.is_sender:
            raise RuntimeError(f"weight group: member {self.rank} sends")
        self.received, self._reuse = 0, reuse
        streams = [self._receive_from(s, pg) for s, pg in enumerate(self.pgs)]
        aborted = None
        while streams:
            # Every receiver walks the senders' buckets in this same order, so no two wait on each other.
            for stream in list(streams):
                try:
                    bucket = next(stream, None)
                except RefitAborted as err:  # the other senders still stream: take the rest of theirs, then raise
                    aborted, bucket = err, None
                if bucket is None:
                    streams.remove(stream)
                elif aborted is None:
                    yield bucket
        self._buffers = self._buffers if reuse else []
        if aborted is not None:
            raise aborted

    def _receive_from(self, s: int, pg) -> Iterator[list[tuple[str, torch.Tensor]]]:
        mode, n = self._open(0, 0, pg)
        if mode == FRAMED:
            layout = []
            while (frame := self._receive_frame(pg)) is not None:
                header, payload = frame
                layout.append((header, payload.numel()))
                self.received += tensor_bytes(header)
                yield bucket_views(header, payload)
            self.layouts[s] = layout
            return
        layout = self.layouts[s]
        if mode != PACKED or layout is None or n != len(layout):
            raise RuntimeError(f"weight group: sender {s} opened a refit with {(mode, n)}, where this member knows "
                               f"{'no' if layout is None else len(layout)} buckets of its layout")

        def post(i):
            if self._reuse:  # two slots of this sender's own
                buf = self._payload(2 * s + i % 2, max(n for _, n in layout))[:layout[i][1]]
            else:
                buf = torch.empty(layout[i][1], dtype=torch.uint8, device=self.device)
            return buf, self._post(buf, pg)

        nxt = post(0) if n else None
        for i in range(n):
            (buf, work), nxt = nxt, (post(i + 1) if i + 1 < n else None)
            work.wait()
            self.received += tensor_bytes(layout[i][0])
            yield bucket_views(layout[i][0], buf)
        if self._mark(0, 0, pg)[0] == ABORT:
            self.layouts[s] = None
            raise RefitAborted(f"weight group: sender {s} failed mid-refit; this refit is incomplete")

    def _receive_frame(self, pg) -> tuple[list, torch.Tensor] | None:
        """One FRAMED bucket: [header bytes, body bytes], the JSON header, the body; None at the end mark,
        RefitAborted at the abort mark."""
        n_head, n_body = self._mark(0, 0, pg)
        if n_head == END:
            return None
        if n_head == ABORT:
            raise RefitAborted("weight group: the sender failed mid-refit; this refit is incomplete")
        head = torch.empty(n_head, dtype=torch.uint8, device=self.device)
        self._broadcast(head, pg)
        body = torch.empty(n_body, dtype=torch.uint8, device=self.device)
        self._broadcast(body, pg)
        return json.loads(bytes(head.cpu().tolist()).decode()), body

    def close(self) -> None:
        self.pg, self.pgs, self.store = None, [], None


_DEVICE_ARG = 6
"""Index of the storage's device in the arguments `torch.multiprocessing.reductions.reduce_tensor` gives for a CUDA
tensor: the sender's device index, which the receiver replaces with its own (each process may number the shared GPU
differently, e.g. under CUDA_VISIBLE_DEVICES)."""


class CudaIpcWeightGroup(WeightGroup):
    """A member of a paired weight-update group, each sender and its receiver on one GPU (`WeightGroup`'s `send` /
    `receive`)."""

    packs = False

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, backend: str = "cuda_ipc",
                 local_rank: int = 0, senders: int = 1, paired: bool = True):
        if backend != "cuda_ipc":
            raise ValueError(f"CudaIpcWeightGroup carries cuda_ipc, not {backend!r}")
        if not paired:
            raise ValueError("a CUDA IPC handle opens only on its own GPU: each sender serves the one receiver on "
                             "its GPU (paired)")
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc refit transport needs CUDA: trainer and engine sharing one GPU")
        super().__init__(host, port, rank, world, timeout_s, "gloo", local_rank, senders, paired=True)
        self.gpu = local_device(local_rank)
        self.backend = "cuda_ipc"

    def _ack(self, pg=None) -> None:
        """Every member has finished with the current bucket (a gloo all-reduce of one element)."""
        import torch.distributed as dist

        (pg or self.pg).allreduce([torch.zeros(1)], dist.AllreduceOptions()).wait()

    def _send_bucket(self, bucket, header: list, nbytes: int, pg=None) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        payload = self._pack(bucket, header, torch.empty(nbytes, dtype=torch.uint8, device=self.gpu))
        torch.cuda.current_stream(self.gpu).synchronize()  # the buffer is complete before another process reads it
        _, args = reduce_tensor(payload)
        head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        handle = torch.frombuffer(bytearray(pickle.dumps(args)), dtype=torch.uint8)
        self._mark(head.numel(), handle.numel())
        self._broadcast(head)
        self._broadcast(handle)
        self._ack()  # the receivers have copied it: the buffer may go
        del payload
        torch.cuda.ipc_collect()  # release the memory torch keeps for buffers shared with other processes
        return tensor_bytes(header)

    def _receive_from(self, s: int, pg) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets as views of the sender's buffers (valid until the next bucket is requested: loaders copy
        them)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if self._open(0, 0, pg)[0] != FRAMED:
            raise RuntimeError("weight group (cuda_ipc): the sender did not open a framed refit")
        while (frame := self._receive_frame(pg)) is not None:  # the body is the buffer's IPC handle
            header, handle = frame
            args = list(pickle.loads(handle.numpy().tobytes()))
            args[_DEVICE_ARG] = self.gpu.index
            payload = rebuild_cuda_tensor(*args)
            self.received += tensor_bytes(header)
            bucket = bucket_views(header, payload)
            yield bucket
            torch.cuda.current_stream(self.gpu).synchronize()  # the loader's copies out of the buffer are done
            del bucket, payload
            self._ack(pg)


GROUPS = {"gloo": WeightGroup, "nccl": WeightGroup, "cuda_ipc": CudaIpcWeightGroup}
"""Weight-update group classes by transport name; each takes WeightGroup's constructor arguments."""


def open_weight_group(host: str, port: int, rank: int, world: int, timeout_s: float, backend: str | None = None,
                      local_rank: int = 0, senders: int = 1, paired: bool | None = None, shard: dict | None = None):
    """Join a weight-update group as member `rank` of `world` (the first `senders` send) over `backend` (one of
    GROUPS; None: nccl where there is a GPU, else gloo), `paired` or not (None: as the transport requires, paired
    for CUDA IPC only), `shard`ed or not (`WeightGroup`; never with CUDA IPC, whose pairs carry whole tensors).
    Every member of one group must name the same backend, pairing and sharding."""
    backend = backend or collective_backend()
    if backend not in GROUPS:
        raise ValueError(f"weight group: unknown transport {backend!r} (one of {', '.join(GROUPS)})")
    if paired is None:
        paired = backend == "cuda_ipc"
    if backend == "cuda_ipc":
        shard = None
    return GROUPS[backend](host, port, rank, world, timeout_s, backend, local_rank=local_rank, senders=senders,
                           paired=paired, **({"shard": shard} if shard else {}))
