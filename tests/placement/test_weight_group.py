"""The weight-update group (`megatron_spec.distributed.weight_group`) on gloo, one sender and two receivers in spawned
processes: buckets arrive whole, in order, cast to the served dtype (integers untouched); a sender that fails
mid-stream makes every receiver raise instead of waiting; a tensor on the wrong device is refused."""

import multiprocessing as mp
import pickle

import pytest
import torch

from megatron_spec.distributed.process_groups import free_port
from megatron_spec.distributed.weight_group import RefitAborted, WeightGroup


def buckets():
    g = torch.Generator().manual_seed(0)
    return [[("a", torch.randn(3, 4, generator=g)), ("odd", torch.randn(3, generator=g)), ("ids", torch.arange(5))],
            [("c", torch.randn(2, 2, generator=g, dtype=torch.float64)), ("scalar", torch.tensor(2.5))],
            [("empty", torch.zeros(0, 7))]]


def _member(rank, port, fail, out):
    group = WeightGroup("127.0.0.1", port, rank, 3, 60, "gloo")
    try:
        if rank == 0:
            def stream():
                for i, b in enumerate(buckets()):
                    if fail and i == 1:
                        raise ValueError("export failed")
                    yield b
            out.put((rank, "sent", group.send(stream(), torch.bfloat16)))
        else:
            got = [[(n, t.clone()) for n, t in b] for b in group.receive()]
            out.put((rank, "received", pickle.dumps(got)))  # plain bytes: no shared-memory tensors
    except (ValueError, RefitAborted) as err:
        out.put((rank, type(err).__name__, str(err)))


def _run(fail):
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, port, fail, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    return results


def test_buckets_arrive_in_the_served_dtype():
    """Every receiver gets the three buckets with the same names and shapes; floating tensors are exactly the
    sender's cast to bf16, the integer tensor unchanged; the sender reports the bytes it sent (bf16: 2 per
    element, int64: 8). The int64 tensor follows 15 bf16 elements: the payload's 16-byte alignment must place it
    where an int64 view can start."""
    results = _run(fail=False)
    assert results[0] == ["sent", 12 * 2 + 3 * 2 + 5 * 8 + 4 * 2 + 1 * 2]
    for rank in (1, 2):
        status, got = results[rank]
        got = pickle.loads(got)
        assert status == "received" and len(got) == 3
        for sent, recv in zip(buckets(), got):
            assert [n for n, _ in sent] == [n for n, _ in recv]
            for (_, s), (_, r) in zip(sent, recv):
                want = s.to(torch.bfloat16) if s.is_floating_point() else s
                assert r.dtype == want.dtype and r.shape == want.shape and torch.equal(r, want)


def test_sender_failure_reaches_every_receiver():
    """The export fails at the second bucket: the sender re-raises its error, both receivers raise RefitAborted
    (after receiving the first bucket) instead of waiting for the rest until the timeout."""
    results = _run(fail=True)
    assert results[0] == ["ValueError", "export failed"]
    assert results[1][0] == results[2][0] == "RefitAborted"


def test_wrong_device_is_refused_before_the_collective():
    """A gloo group takes host tensors only: a meta tensor is refused with the device named (a one-rank group)."""
    group = WeightGroup("127.0.0.1", free_port(), 0, 1, 30, "gloo")
    with pytest.raises(RuntimeError, match="a tensor on meta where cpu is needed"):
        group._broadcast(torch.empty(2, device="meta"))


def test_transport_follows_the_placement():
    """NCCL between separate GPUs; CUDA IPC only where the single engine worker shares the single sender's GPU (a
    handle opens on the GPU it was made on, and under Ray each actor sees only its own GPU; a second pipeline
    stage sends from another GPU); gloo on CPUs and for the other colocated layouts."""
    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import weight_backend

    gpu, cpu = {"CPU": 4.0, "GPU": 1.0}, {"CPU": 1.0}
    assert weight_backend(Placement("disaggregated", 2, 2, gpu)) == "nccl"
    assert weight_backend(Placement("colocated", 1, 1, gpu)) == "cuda_ipc"
    assert weight_backend(Placement("colocated", 2, 1, gpu), senders=2) == "gloo"  # stage 1 sends from GPU 1
    assert weight_backend(Placement("colocated", 2, 1, gpu, engine_tp=2)) == "gloo"
    assert weight_backend(Placement("colocated", 2, 2, gpu)) == "gloo"
    assert weight_backend(Placement("colocated", 1, 1, cpu)) == "gloo"
    assert weight_backend(Placement("disaggregated", 1, 1, cpu)) == "gloo"


def test_cuda_ipc_without_cuda_is_refused_before_the_rendezvous():
    """No rendezvous is attempted (the port is never listened on): the error names what is missing at once."""
    from megatron_spec.distributed.weight_group import open_weight_group

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="cuda_ipc refit transport needs CUDA"):
        open_weight_group("127.0.0.1", free_port(), 1, 2, 0.5, "cuda_ipc")
    with pytest.raises(ValueError, match="unknown transport 'ipc'"):
        open_weight_group("127.0.0.1", free_port(), 1, 2, 0.5, "ipc")


def test_refit_bucket_follows_the_devices_and_the_config():
    """backend.refit_bucket_mb = 0 takes the devices' default (512 MiB where a bundle has a GPU, the measured CPU
    best elsewhere); a set value wins on either; a negative one is refused naming the field."""
    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import CPU_BUCKET_MB, GPU_BUCKET_MB, bucket_bytes
    from megatron_spec.rl.backend_config import BackendSection
    from megatron_spec.rl.config import RLConfig

    cfg = RLConfig()
    gpu = Placement("disaggregated", 1, 1, {"CPU": 4.0, "GPU": 1.0})
    cpu = Placement("disaggregated", 1, 1, {"CPU": 1.0})
    assert (bucket_bytes(cfg, gpu), bucket_bytes(cfg, cpu)) == (GPU_BUCKET_MB << 20, CPU_BUCKET_MB << 20)
    assert GPU_BUCKET_MB >= 512
    cfg.backend.refit_bucket_mb = 8
    assert bucket_bytes(cfg, gpu) == bucket_bytes(cfg, cpu) == 8 << 20
    with pytest.raises(ValueError, match="backend.refit_bucket_mb must be >= 0"):
        BackendSection(refit_bucket_mb=-1)


def test_sync_metrics_name_the_senders_and_the_waits():
    """The step's weight_sync_* metrics: bytes from the senders' result, seconds the slowest side (sending and
    loading overlap), and the senders' figures as given."""
    from megatron_spec.placement.transport import CollectiveRefit, SendInfo, sync_metrics

    refit = CollectiveRefit.__new__(CollectiveRefit)
    m = sync_metrics(refit, [(600, 2.0, SendInfo(2, 400, 50, 0.25)), (600, 3.0), (600, 1.0)])
    assert m == {"weight_sync_bytes": 600, "weight_sync_s": 3.0, "weight_sync_gbps": 600 / 3.0 / 1e9,
                 "weight_sync_transport": "collective", "weight_sync_senders": 2,
                 "weight_sync_sender_bytes_max": 400, "weight_sync_received_bytes_max": 50,
                 "weight_sync_wait_s": 0.25}
