"""The Megatron trainer's background save (`save_sharded(background=True)` / `finish_save`, through
`rl.checkpoint.Saver`) on 2 gloo ranks: what it writes while the next step updates the weights is the state at the
boundary, equal to a foreground save of it, and a policy resumed from it at another layout takes the same next step;
so with the writer thread and with the writer process; a rank whose write fails fails the save on both.
The runs are in `async_save_workers.py`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import async_save_workers as w  # noqa: E402

pytestmark = pytest.mark.megatron_dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron_spec.trainers.megatron.parallel import spawn

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


def test_a_failed_background_write_leaves_the_previous_checkpoint(saved):
    """Rank 1's writer fails during the step-2 background save: the finalization raises on both ranks (no rank is
    left waiting for the other) and rank 0's Saver names nothing new: `latest` still names step 1, whose files are
    byte for byte as they were, and the half-written directory is gone."""
    r0, r1 = saved[0]["failed"], saved[1]["failed"]
    for r in (r0, r1):
        assert r["raised"].startswith("RuntimeError: background checkpoint write failed"), r["raised"]
    assert r0["latest"] == "step_000001" and r0["unchanged"] and r0["new"] == []
    assert r0["dirs"] == ["latest", "step_000000", "step_000001"]


def test_the_writer_process_writes_the_state_at_the_boundary(saved):
    """`run.async_save_writer="process"`: each rank's shards are written by a spawned process of its own (another
    pid), from the shared-memory copy taken at the boundary: every tensor equals, bitwise, the foreground save of
    the same state, although the step that ran before the held write was released changed every weight."""
    for rank in saved:
        assert rank["process"]["pid"] != rank["process"]["me"]
    assert saved[0]["process"]["pid"] != saved[1]["process"]["pid"]
    assert saved[0]["process"]["keys"] > 0 and saved[0]["process"]["equal"]


def test_torchrun_recipe_resumes_from_a_background_save(tmp_path):
    """The tiny MoE recipe under torchrun (EP2; rank 1 follows rank 0's announced calls, `finish_save` included),
    saving every step: steps 0 and 1 are saved in the background (logged `save_background_s` at the next boundary),
    step 2 at the end in the foreground. A copy of the run cut back to step 1's background checkpoint resumes and
    its step 2 equals the straight run's exactly (loss, grad norm, reward, acceptance, drafter loss)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from .test_recipe_torchrun import RECIPE, ROOT

    def run(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", RECIPE,
               "backend.trainer=megatron", "backend.megatron.ep=2", "run.steps=3", "run.save_every=1",
               "run.report=false", f"run.out_dir={out}", *extra]
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "straight", "run.resume=false")
    assert [sorted(k for k in m if k.startswith("save_")) for m in straight] == [
        ["save_blocking_s"], ["save_background_s", "save_blocking_s"], ["save_background_s", "save_blocking_s"]]
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "straight", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    (cut / "checkpoints" / "latest").write_text("step_000001")
    resumed = run(cut)[-1]
    keys = ["step", "loss", "grad_norm", "reward_mean", "acceptance_length", "drafter_loss"]
    assert [resumed[k] for k in keys] == [straight[2][k] for k in keys]
