"""The writer process's shared snapshot (`trainers/megatron/writer.py`): copies land in one reused shared buffer,
each a tensor of its own storage; the buckets handed to the process name each tensor by its place in the buffer
and come back as the same tensors; a copy /dev/shm has no room for is refused with the figures."""

import os
from types import SimpleNamespace

import torch

from megatron_spec.trainers.megatron import writer


def test_snapshot_copies_land_in_one_reused_shared_buffer():
    shared = writer.SharedSnapshot()
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(4, dtype=torch.float64)[::2]]
    copies = shared.take(tensors)
    assert shared.buffer.is_shared() and shared.buffer.numel() == 64 * 3
    base = shared.buffer.data_ptr()
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.untyped_storage().nbytes() == c.numel() * c.element_size()
        assert base <= c.data_ptr() < base + shared.buffer.numel()
    tensors[0].add_(1)  # the copy is a copy
    assert not torch.equal(tensors[0], copies[0])
    again = shared.take([torch.ones(2)])
    assert shared.buffer.data_ptr() == base and again[0].data_ptr() == base  # reused, not reallocated


def test_buckets_travel_as_places_in_the_buffer():
    shared = writer.SharedSnapshot()
    inside = shared.take([torch.randn(6, 2)])[0]
    outside = torch.randn(3)
    buckets = [("f0.distcp", "k", ([("item-b", b"bytes")], [("item-0", inside), ("item-1", outside)]))]
    placed = writer._places(shared.buffer, buckets)
    items = placed[0][2][1]
    assert items[0][1] == ("shared", inside.data_ptr() - shared.buffer.data_ptr(), "torch.float32", [6, 2])
    assert items[1][1] is outside
    back = writer._tensors(shared.buffer, placed)[0][2][1]
    assert torch.equal(back[0][1], inside) and back[1][1] is outside
    assert placed[0][:2] == ("f0.distcp", "k") and placed[0][2][0] == [("item-b", b"bytes")]


def test_a_copy_without_room_in_dev_shm_is_refused_with_the_figures(monkeypatch):
    shared = writer.SharedSnapshot()
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=1, f_frsize=4096))
    assert shared.fits([torch.zeros(1024)]) == (True, 4096, 4096)
    assert shared.fits([torch.zeros(1025)]) == (False, 4160, 4096)


def test_a_snapshot_without_room_is_copied_for_the_thread_instead(monkeypatch, capsys):
    """`checkpoint.snapshot` into a shared snapshot /dev/shm cannot hold: False, a line naming the figures and the
    fix, and each host tensor cloned as for the writer thread (the buffer untouched)."""
    import pytest

    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_spec.trainers.megatron.checkpoint import snapshot

    live = torch.randn(4096)
    sd = {"w": ShardedTensor.from_rank_offsets("w", live)}
    shared = writer.SharedSnapshot()
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=1, f_frsize=4096))
    assert snapshot(sd, shared) is False
    assert "needs 0.0 GiB of /dev/shm" in capsys.readouterr().out and shared.buffer.numel() == 0
    assert torch.equal(sd["w"].data, live) and sd["w"].data.data_ptr() != live.data_ptr()
    monkeypatch.undo()
    sd = {"w": ShardedTensor.from_rank_offsets("w", live)}
    assert snapshot(sd, shared) is True and sd["w"].data.data_ptr() == shared.buffer.data_ptr()
