"""Process-group start-up (`megatron_spec.distributed.process_groups`) on gloo, in spawned processes: every collective
tensor lives on the device its backend needs (checked by a wrapper around torch.distributed's collectives), LOCAL_RANK
is the index on the node, and a rank that never arrives is named, by rank 0 and by the ranks that did arrive."""

import multiprocessing as mp
import time

import pytest
import torch

from megatron_spec.distributed.process_groups import JoinError, collective_device, free_port, local_ranks, start_process_group


def test_local_rank_is_the_index_on_its_node():
    """Five ranks on two nodes, interleaved: each counts from 0 on its own node, never the global rank."""
    assert local_ranks(["a", "b", "a", "b", "a"]) == [0, 0, 1, 1, 2]
    assert local_ranks(["n"]) == [0]


def test_collective_device_per_backend():
    """gloo takes host tensors; NCCL the rank's GPU (GPU `local_rank` where a process sees several, as without Ray's
    per-actor CUDA_VISIBLE_DEVICES); anything else is refused."""
    assert collective_device("gloo", 3) == torch.device("cpu")
    if torch.cuda.device_count() != 1:
        assert collective_device("nccl", 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="unknown collective backend"):
        collective_device("mpi")


def _member(rank, world, port, timeout_s, out):
    """One rank: start the group with every collective's tensors checked against the backend's device."""
    import torch.distributed as dist

    checked = []

    def guard(fn):
        def wrapped(tensor, *args, **kwargs):
            want = collective_device(dist.get_backend(), 0)
            assert tensor.device == want, f"{fn.__name__} got a tensor on {tensor.device}, {want} needed"
            checked.append(fn.__name__)
            return fn(tensor, *args, **kwargs)
        return wrapped

    dist.all_reduce, dist.broadcast = guard(dist.all_reduce), guard(dist.broadcast)
    try:
        backend = start_process_group(rank, world, rank, "127.0.0.1", port, timeout_s)
        out.put((rank, "ok", backend, checked, dist.get_world_size()))
        dist.destroy_process_group()
    except JoinError as err:
        out.put((rank, "error", str(err), checked, None))


def _run(ranks, world, timeout_s):
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, timeout_s, out)) for r in ranks]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + 120
    while len(results) < len(ranks) and time.time() < deadline:
        rank, *rest = out.get(timeout=120)
        results[rank] = rest
    for p in procs:
        p.join(30)
    return results


def test_gloo_group_starts_with_host_tensors_only():
    """Two ranks form a gloo group; the start-up all-reduce counted both and went through the device check."""
    results = _run([0, 1], 2, 60)
    for rank in (0, 1):
        status, backend, checked, world = results[rank]
        assert (status, backend, world) == ("ok", "gloo", 2), results[rank]
        assert checked == ["all_reduce"]


def test_missing_rank_is_named():
    """World 3, rank 2 never starts: after the 4 s timeout rank 0 names rank 2 as missing (and ranks 0, 1 as
    present), and rank 1, which did join, reports the same missing rank instead of hanging."""
    results = _run([0, 1], 3, 4)
    status, msg, _, _ = results[0]
    assert status == "error" and "rank(s) [2] of 3 did not join" in msg and "[0, 1]" in msg
    status, msg, _, _ = results[1]
    assert status == "error" and "rank 1 joined" in msg and "2 of 3 never arrived" in msg
