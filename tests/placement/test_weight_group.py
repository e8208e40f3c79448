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
    """NCCL between separate GPUs; colocated on GPUs, CUDA IPC wherever every engine worker shares its GPU with a
    trainer rank (any engine TP, any number of pipeline stages: rank u serves worker u), with one sender per
    engine worker; gloo where an engine worker's GPU has no trainer rank (an IPC handle opens only on its own GPU),
    and on CPUs, with one sender per pipeline stage."""
    from types import SimpleNamespace

    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import weight_backend, weight_senders

    gpu, cpu = {"CPU": 4.0, "GPU": 1.0}, {"CPU": 1.0}
    assert weight_backend(Placement("disaggregated", 2, 2, gpu)) == "nccl"
    assert weight_backend(Placement("colocated", 1, 1, gpu)) == "cuda_ipc"
    assert weight_backend(Placement("colocated", 2, 1, gpu)) == "cuda_ipc"  # rank 0 serves the one worker
    assert weight_backend(Placement("colocated", 2, 2, gpu)) == "cuda_ipc"
    assert weight_backend(Placement("colocated", 4, 2, gpu, engine_tp=2)) == "cuda_ipc"
    assert weight_backend(Placement("colocated", 8, 2, gpu, engine_tp=2)) == "cuda_ipc"  # ranks 4-7 send nothing
    assert weight_backend(Placement("colocated", 1, 1, gpu, engine_tp=2)) == "gloo"  # worker 1's GPU has no rank
    assert weight_backend(Placement("colocated", 2, 2, gpu, engine_tp=2)) == "gloo"
    assert weight_backend(Placement("colocated", 1, 1, cpu)) == "gloo"
    assert weight_backend(Placement("colocated", 4, 2, cpu, engine_tp=2)) == "gloo"
    assert weight_backend(Placement("disaggregated", 1, 1, cpu)) == "gloo"
    cfg = SimpleNamespace(backend=SimpleNamespace(trainer="megatron", megatron=SimpleNamespace(pp=2)))
    tp2 = Placement("colocated", 8, 2, gpu, engine_tp=2)
    assert weight_senders(cfg, "cuda_ipc", tp2) == 4 and weight_senders(cfg, "gloo", tp2) == 2
