"""The Megatron trainer's background save (`save_sharded(background=True)` / `finish_save`, through
`rl.checkpoint.Saver`) on 2 gloo ranks: what it writes while the next step updates the weights is the state at the
boundary, equal to a foreground save of it, and a policy resumed from it at another layout takes the same next step.
The runs are in `async_save_workers.py`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import async_save_workers as w  # noqa: E402

pytestmark = pytest.mark.megatron_dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron_spec.backends.megatron.parallel import spawn

    return spawn(w.background_vs_foreground, 2, str(tmp_path_factory.mktemp("async_save")))


def equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_background_save_holds_the_state_at_the_boundary(saved):
    """Per rank: the weights loaded at PP2 from the background save equal, bitwise, those loaded from the foreground
    save of the same state, and differ from the weights after the step its write overlapped (so the write read the
    copy taken at the boundary, not the live parameters). Rank 0's metrics: the foreground save blocks, the
    background one reports its write when finalized."""
    for rank in saved:
        assert equal(rank[0]["loaded"], rank[1]["loaded"])
        assert not equal(rank[1]["loaded"], rank["overlapped"])
    m = saved[0]["metrics"]
    assert set(m[0]) == set(m[1]) == {"save_blocking_s"} and set(m["finished"]) == {"save_background_s"}


def test_resume_from_the_background_save_takes_the_same_next_step(saved):
    """From either checkpoint the next step (at PP2) gives the same loss and the same weights bitwise: the
    background save holds the Adam moments and step as the foreground one does."""
    for rank in saved:
        a, b = rank[0]["next"], rank[1]["next"]
        assert a["metrics"][0]["loss"] == b["metrics"][0]["loss"]
        assert equal(a["weights"][-1], b["weights"][-1])
