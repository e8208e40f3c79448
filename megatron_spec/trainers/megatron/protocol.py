"""How rank 0 has the other ranks of a Megatron trainer make its calls.

Every rank holds one `MegatronPolicy` and every method is collective. Either every rank makes the same calls
(SPMD, `followers=False`: the tests), or, for the RL loop, which runs on rank 0 only and never sees
torch.distributed, rank 0's calls are first announced to the other ranks (`announce`: method name and arguments,
one broadcast), which wait in `Followers.follow` and make the same call (`from_rl` sets `followers`; `launch.py`
starts the ranks). A single process (world size 1) is the same code without announcements.
"""

from __future__ import annotations

import torch.distributed as dist

STOP = "__stop__"
"""Ends the followers' loop (and, sent before any policy is built, `launch.follow_run`)."""
BUILD = "__build__"
"""Carries the run's config to the other ranks, which build their policy from it (`launch.follow_run`)."""


def announce(name: str, *args) -> None:
    """Rank 0: tell every other rank to call `name(*args)` (one broadcast)."""
    dist.broadcast_object_list([(name, args)], src=0)


def receive() -> tuple[str, tuple]:
    """Ranks > 0: wait for rank 0's next announcement, (name, args)."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Followers:
    """The protocol's side of `MegatronPolicy` (mixed into it): with `leader` set (rank 0 of a loop-driven run),
    each collective method announces itself first (`_announce`); the other ranks wait in `follow`."""

    leader: bool = False

    def _announce(self, name: str, *args) -> None:
        if self.leader:
            announce(name, *args)

    def follow(self) -> None:
        """Ranks > 0: make every call rank 0 announces, until it stops (`stop`)."""
        while True:
            name, args = receive()
            if name == STOP:
                return
            result = getattr(self, name)(*args)
            if name == "export_weights":
                for _ in result:  # the export is collective: drain it as rank 0 does
                    pass

    def stop(self) -> None:
        """Rank 0: release the followers."""
        self._announce(STOP)
