"""Peak-memory figures of `memory` against a measured allocation, and their TensorBoard scalars."""

from __future__ import annotations

import sys

import pytest

from megatron_spec import memory
from megatron_spec.rl.logging import scalars

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ALLOC = 200 * memory.MB


PEAK_PROBE = """
import torch
from megatron_spec import memory
assert memory.reset_peak()
before = memory.peak_rss_bytes()
x = torch.ones(ALLOC // 4)  # float32: every page written
during, resident = memory.peak_rss_bytes(), memory.rss_bytes()
del x
memory.reset_peak()
print(before, during, resident, memory.peak_rss_bytes(), memory.rss_bytes())
"""


def test_peak_rises_by_an_allocation_and_resets():
    """Writing every page of a 200 MiB tensor raises the peak RSS by at least 190 MiB (the process's other pages
    stay resident, so nothing can offset it but the allocator reusing pages freed just before: < 10 MiB in a fresh
    process, which is why this runs in one: a test process that freed gigabytes before would reuse those resident
    pages); after it is freed and the peak reset, the peak is back within 20 MiB of the current RSS, i.e. the reset
    really starts a new peak (what makes the per-step figures per step)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", f"ALLOC = {ALLOC}\n" + PEAK_PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, during, resident, peak_after, rss_after = map(int, done.stdout.split())
    assert during - before >= 190 * memory.MB
    assert resident >= ALLOC  # resident then, not only counted
    assert peak_after - rss_after <= 20 * memory.MB
    assert peak_after < during - 150 * memory.MB


def test_step_memory_reports_children_and_tensorboard_scalars():
    """A child process that touches 200 MiB shows in `children_peak_rss_mb` with at least 190 MiB; the loop's
    own peak is at least its current RSS; TensorBoard gets one `memory/` curve per figure and per rank."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; b = bytearray(b'x' * (200 << 20)); print('ok', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        m = memory.step_memory()
    finally:
        child.communicate("")
    assert m["loop_peak_rss_mb"] >= memory.rss_bytes() / memory.MB - 1
    assert max(m["children_peak_rss_mb"]) >= 190
    tags = dict(scalars({"step": 0, "memory": {**m, "trainer_peak_rss_mb": [1.0, 2.0]}}))
    assert tags["memory/loop_peak_rss_mb"] == m["loop_peak_rss_mb"]
    assert tags["memory/trainer_peak_rss_mb_0"] == 1.0 and tags["memory/trainer_peak_rss_mb_1"] == 2.0


def test_report_lists_each_ranks_largest_peak(tmp_path):
    """The report's memory table keeps, per figure and per rank, the largest peak over the steps (step 0's
    start-up peak on rank 0, step 1's on rank 1 here), and leaves it out for runs that logged none."""
    from megatron_spec.rl.report import Run, _memory_html, memory_rows

    steps = [{"step": 0, "memory": {"loop_peak_rss_mb": 900.0, "trainer_peak_rss_mb": [900.0, 400.0]}},
             {"step": 1, "memory": {"loop_peak_rss_mb": 700.0, "trainer_peak_rss_mb": [650.0, 450.0]}}]
    run = Run(tmp_path, "m", "plain", "plain", None, 0, False, steps)
    bare = Run(tmp_path, "e", "plain", "plain", None, 0, False, [{"step": 0}])
    rows = memory_rows([run, bare])
    assert rows == [{"run": run.label, "loop_peak_rss_mb": [900.0], "trainer_peak_rss_mb": [900.0, 450.0]}]
    assert "900 / 450" in "".join(_memory_html([run]))
    assert _memory_html([bare]) == []
