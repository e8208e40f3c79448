"""The weight-update group with two senders (one per pipeline stage) and two receivers, on gloo in spawned
processes: every receiver gets each sender's buckets exactly, the senders taken at once (a bucket of each in
turn, in sender order: the order every receiver walks them in, so none waits on another); a sender is in no group but its
own; the first refit carries the headers and every later one only the payloads, until a sender's tensor set
changes (its key says so) and that sender resends its headers once; a failure, or a layout changed behind an
unchanged key, in a PACKED refit reaches every receiver as RefitAborted; a paired group serves one receiver per
sender."""

import multiprocessing as mp
import pickle

import pytest
import torch

from megatron_spec.distributed.process_groups import free_port
from megatron_spec.distributed.weight_group import RefitAborted, WeightGroup

SENDERS, WORLD = 2, 4


def stage(sender: int, refit: int, shape=(3, 4)):
    """Sender `sender`'s buckets at `refit`: different values every refit, int64 after odd-sized bf16 tensors."""
    g = torch.Generator().manual_seed(100 * sender + refit)
    return [[(f"s{sender}.a", torch.randn(*shape, generator=g)), (f"s{sender}.odd", torch.randn(3, generator=g)),
             (f"s{sender}.ids", torch.arange(5) + refit)],
            [(f"s{sender}.b", torch.randn(2, 2, generator=g, dtype=torch.float64))],
            [(f"s{sender}.c", torch.randn(7, generator=g))]]


def in_turn(*streams):
    """The buckets of each sender's stream taken one of each in turn, in sender order, until all are done."""
    out = []
    for i in range(max(len(b) for b in streams)):
        out += [b[i] for b in streams if i < len(b)]
    return out


def drafter(refit: int):
    """A bucket that joins sender 1's tensor set (a drafter added between refits)."""
    return [("drafter.fc", torch.full((2, 3), float(refit))), ("drafter.norm", torch.arange(4.0) + refit)]


def _member(rank, port, plan, paired, out):
    group = WeightGroup("127.0.0.1", port, rank, WORLD, 60, "gloo", senders=SENDERS, paired=paired)
    posts = counted_posts(group)
    results = []
    for refit, what in enumerate(plan):
        posts.clear()
        try:
            if group.is_sender:
                def stream():
                    for i, b in enumerate(stage(rank, refit, (4, 3) if what == "reshape" and rank == 1 else (3, 4))):
                        if what == "fail" and rank == 1 and i == 1:
                            raise ValueError("export failed")
                        yield b
                    if what == "grow" and rank == 1:  # a drafter joins sender 1's set
                        yield drafter(refit)
                key = "with drafter" if what == "grow" and rank == 1 else None
                results.append(("sent", group.send(stream(), torch.bfloat16, key), len(posts), len(group.pgs)))
            else:
                got = [[(n, t.clone()) for n, t in b] for b in group.receive()]
                results.append(("received", got, group.received, len(posts), len(group.pgs)))
        except (ValueError, RuntimeError) as err:
            results.append((type(err).__name__, str(err)))
    out.put((rank, pickle.dumps(results)))  # plain bytes: no shared-memory tensors outlive the process


def counted_posts(group) -> list[int]:
    """The sizes of the collectives `group` posts from now on, appended as they are posted."""
    posts, post = [], group._post
    group._post = lambda t, pg=None: (posts.append(t.numel()), post(t, pg))[1]
    return posts


def spawn(member, *args, world: int = WORLD, timeout: float = 180) -> dict:
    """Run `member(rank, port, *args, out)` as `world` spawned processes on one rendezvous port; each rank's
    results (what it put on `out`, pickled)."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=member, args=(r, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {r: pickle.loads(b) for r, b in (out.get(timeout=timeout) for _ in procs)}
    for p in procs:
        p.join(30)
    return results


def _run(plan, paired=False):
    return spawn(_member, plan, paired)


def _bytes(buckets) -> int:
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for b in buckets for _, t in b)


def test_each_receiver_gets_every_stage_from_its_own_sender_and_headers_only_once():
    """Three refits. Each sender reports exactly its own stage's bytes and sits in one process group (its own);
    each receiver gets both senders' three buckets, one of each in turn, floating tensors equal to the sender's cast to
    bf16, integers unchanged, and counts both stages' bytes. Broadcasts per sender and refit after the opening
    all-reduce: the first (FRAMED) 3 per bucket + 1 ([sizes, header, payload] per bucket, end), the later ones
    (PACKED) 1 per bucket + 1: no per-bucket header."""
    results = _run(["ok", "ok", "ok"])
    for refit in range(3):
        buckets_posts = 3 * 3 + 1 if refit == 0 else 3 + 1
        for s in range(SENDERS):
            assert results[s][refit] == ("sent", _bytes(stage(s, refit)), buckets_posts, 1)
        for r in (2, 3):
            status, got, received, posts, groups = results[r][refit]
            want = in_turn(stage(0, refit), stage(1, refit))
            assert status == "received" and len(got) == 6
            assert received == _bytes(want) and posts == SENDERS * buckets_posts
            for sent, recv in zip(want, got):
                assert [n for n, _ in sent] == [n for n, _ in recv]
                for (_, a), (_, b) in zip(sent, recv):
                    a = a.to(torch.bfloat16) if a.is_floating_point() else a
                    assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)


def test_a_packed_refit_that_fails_or_changes_layout_aborts_every_receiver_and_the_next_one_recovers():
    """Refit 1 (PACKED): sender 1's export raises at its second bucket; refit 3 (PACKED again after refit 2
    re-sent the headers): sender 1's first tensor changes shape. Each time sender 1 raises, and both receivers,
    having taken sender 0's refit whole, raise RefitAborted instead of waiting. The refit after each failure goes
    FRAMED for sender 1 (its layout was dropped) and arrives whole; sender 0 stays PACKED throughout."""
    results = _run(["ok", "fail", "ok", "reshape", "ok"])
    assert results[1][1] == ("ValueError", "export failed")
    assert results[1][3][0] == "RuntimeError" and "differs from the layout" in results[1][3][1]
    for r in (2, 3):
        for refit in (1, 3):
            assert results[r][refit][0] == "RefitAborted" and "sender 1" in results[r][refit][1]
        for refit in (2, 4):
            status, got, received, posts, _ = results[r][refit]
            assert status == "received" and received == _bytes(stage(0, refit) + stage(1, refit))
            assert posts == (3 + 1) + (3 * 3 + 1)
    for refit in (2, 4):
        assert results[0][refit] == ("sent", _bytes(stage(0, refit)), 3 + 1, 1)
        assert results[1][refit] == ("sent", _bytes(stage(1, refit)), 3 * 3 + 1, 1)


def test_a_paired_group_gives_each_receiver_its_own_senders_stream_only():
    """Paired (the per-GPU CUDA IPC refit's shape, here on gloo): receiver 2 takes sender 0's stream and receiver 3
    sender 1's, each whole and exact, each member in one process group of two; two refits, the first FRAMED
    (3 broadcasts per bucket + end), the second PACKED (1 per bucket + end). A paired group of the wrong size is
    refused before any rendezvous."""
    results = _run(["ok", "ok"], paired=True)
    for refit in range(2):
        posts = 3 * 3 + 1 if refit == 0 else 3 + 1
        for s in range(SENDERS):
            assert results[s][refit] == ("sent", _bytes(stage(s, refit)), posts, 1)
        for r, s in ((2, 0), (3, 1)):
            status, got, received, n_posts, groups = results[r][refit]
            assert (status, received, n_posts, groups) == ("received", _bytes(stage(s, refit)), posts, 1)
            for sent, recv in zip(stage(s, refit), got, strict=True):
                assert [n for n, _ in sent] == [n for n, _ in recv]
                for (_, a), (_, b) in zip(sent, recv):
                    assert torch.equal(a.to(torch.bfloat16) if a.is_floating_point() else a, b)
    with pytest.raises(ValueError, match="paired, each of the 2 sender"):
        WeightGroup("127.0.0.1", free_port(), 0, 3, 5, "gloo", senders=2, paired=True)


def test_a_sender_failing_in_a_framed_refit_leaves_the_others_streaming_to_the_end():
    """Refit 0 (FRAMED): sender 1 sends its abort mark after its first bucket, while sender 0 still has two to
    send. The receivers take sender 0's stream to its end before raising RefitAborted, so sender 0's refit
    completes instead of waiting in a broadcast no one receives (it would fail at the group's timeout); refit 1 is
    whole on every receiver, sender 0 PACKED (its layout stands) and sender 1 FRAMED again."""
    results = _run(["fail", "ok"])
    assert results[0][0] == ("sent", _bytes(stage(0, 0)), 3 * 3 + 1, 1)
    assert results[1][0] == ("ValueError", "export failed")
    for r in (2, 3):
        assert results[r][0][0] == "RefitAborted"
        status, got, received, posts, _ = results[r][1]
        want = in_turn(stage(0, 1), stage(1, 1))
        assert (status, received, posts) == ("received", _bytes(want), (3 + 1) + (3 * 3 + 1))
        for sent, recv in zip(want, got, strict=True):
            for (_, a), (_, b) in zip(sent, recv, strict=True):
                assert torch.equal(a.to(torch.bfloat16) if a.is_floating_point() else a, b)


def test_a_tensor_set_that_changes_between_refits_resends_its_headers_once():
    """Refit 0 sends both stages' sets; from refit 1 on, sender 1's set gains a drafter bucket and its key says so:
    refit 1 is FRAMED again for sender 1 (headers resent, 3 broadcasts per bucket) while sender 0 stays PACKED,
    and every receiver takes the new set whole, drafter included, with no abort; refit 2, the same set again,
    is PACKED for both (the new headers kept)."""
    results = _run(["ok", "grow", "grow"])
    assert results[0][1] == ("sent", _bytes(stage(0, 1)), 3 + 1, 1)
    assert results[1][1] == ("sent", _bytes(stage(1, 1) + [drafter(1)]), 4 * 3 + 1, 1)
    for s in range(SENDERS):
        want = stage(s, 2) + ([drafter(2)] if s == 1 else [])
        assert results[s][2] == ("sent", _bytes(want), len(want) + 1, 1)
    for r in (2, 3):
        for refit, posts in ((1, (3 + 1) + (4 * 3 + 1)), (2, (3 + 1) + (4 + 1))):
            status, got, received, n_posts, _ = results[r][refit]
            want = in_turn(stage(0, refit), stage(1, refit) + [drafter(refit)])
            assert (status, received, n_posts) == ("received", _bytes(want), posts)
            for sent, recv in zip(want, got, strict=True):
                assert [n for n, _ in sent] == [n for n, _ in recv]
                for (_, a), (_, b) in zip(sent, recv):
                    assert torch.equal(a.to(torch.bfloat16) if a.is_floating_point() else a, b)
