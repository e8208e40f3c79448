"""Rendezvous ports without a gap: a store this process hosts is bound at once on the launcher's fixed port or on one
the OS picks (`process_groups.host_rendezvous`), never picked, released and bound again; and trainer rank 0 forms
the weight-update group again on its fixed port after closing the old one (`TrainerRank.close_weights`, what
`CollectiveRefit.reconnect` does before it reconnects)."""

import socket
import threading

import pytest
import torch

from megatron_spec.distributed import process_groups
from megatron_spec.distributed.process_groups import JoinError, free_port, host_rendezvous
from megatron_spec.distributed.weight_group import WeightGroup, open_weight_group


def test_a_hosted_rendezvous_holds_its_port_from_the_start():
    """Port 0: the store holds the port the OS gave it (another bind there fails at once), two stores get two ports,
    and rank 0 of a group at that port forms with the hosted store instead of binding a new one."""
    a, b = host_rendezvous("127.0.0.1", 0), host_rendezvous("127.0.0.1", 0)
    assert a > 0 and b > 0 and a != b
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("", a))
    hosted = process_groups._hosted[a]
    group = WeightGroup("127.0.0.1", a, 0, 1, 30, "gloo")
    assert group.store is hosted and a not in process_groups._hosted
    process_groups._hosted.pop(b)  # release the second store


def _receive(port: int, out: list) -> None:
    group = open_weight_group("127.0.0.1", port, 1, 2, 60, "gloo")
    out.extend((n, t.clone()) for bucket in group.receive() for n, t in bucket)
    group.close()


def test_trainer_rank_forms_the_weight_group_again_on_its_fixed_port(monkeypatch):
    """MEGATRON_SPEC_WEIGHTS_PORT fixed: rank 0 hosts the group there, a receiver gets the bucket; hosting again
    while that group is open fails naming the port; after `close_weights` the group forms again on the same port
    and the next bucket arrives exactly."""
    from megatron_spec.placement.workers import TrainerRank

    port = free_port()
    monkeypatch.setenv("MEGATRON_SPEC_WEIGHTS_PORT", str(port))
    rank = TrainerRank(None, 0, 1, torch.get_num_threads())
    for round_ in range(2):
        host, got = rank.host_port()
        assert got == port
        received: list = []
        receiver = threading.Thread(target=_receive, args=(port, received))
        receiver.start()
        rank.join_weights("127.0.0.1", port, 2, 60, "gloo")
        sent = torch.full((3, 2), float(round_ + 1))
        rank.weights.send([[("w", sent)]])
        receiver.join(60)
        assert [n for n, _ in received] == ["w"] and torch.equal(received[0][1], sent)
        with pytest.raises(JoinError, match=f"port {port}"):
            rank.host_port()  # the open group's store still holds the fixed port
        rank.close_weights()
        assert rank.weights is None
