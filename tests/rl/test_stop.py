"""Saving on a signal and by time (`megatron_spec/rl/stop.py`, the loop's `run`): a SIGUSR1 or SIGTERM raised during
a step ends the run after that step with a checkpoint of it, and a resubmission resumes there so metrics.jsonl holds
every step exactly once; `run.save_every_s` saves by an injected clock; the cadence fields are checked before
any compute."""

import os
import signal

import pytest
import torch

from megatron_spec.rl import loop
from megatron_spec.rl.config import RLConfig, RunSection
from megatron_spec.rl.logging import read_metrics
from megatron_spec.rl.overrides import apply_overrides
from megatron_spec.rl.stop import SaveClock, StopRequest, save_due

from .test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)


def latest(run_dir) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def signalling_trainer(at_step: int, signum: int):
    """A Trainer that sends this process `signum` from inside step `at_step`, after its rollouts: the signal
    arrives while a step is in flight, as SLURM's does."""

    class Signalling(loop.Trainer):
        def step(self, step):
            metrics = super().step(step)
            if step == at_step:
                os.kill(os.getpid(), signum)  # delivered to this (the main) thread before kill returns
            return metrics

    return Signalling


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_saves_at_the_step_boundary_and_a_resume_logs_every_step_once(ckpts, tmp_path, shaped_reward,
                                                                               signum):
    """6 steps, no step cadence before the end (save_every=0): the signal during step 2 finishes that step, saves
    step_000002 (which `latest` names and whose state.pt says step 2), returns `stopped_on` with the signal's name
    and restores the earlier handler; the resumed run does steps 3-5 only, so metrics.jsonl holds 0..5 once each,
    and its rewards and losses equal an uninterrupted run's."""
    cfg = small_cfg(ckpts, tmp_path / "cut")
    cfg.run.steps, cfg.run.save_every = 6, 0
    before = signal.getsignal(signum)
    out = loop.run(cfg, signalling_trainer(2, signum))
    assert out["stopped_on"] == signal.Signals(signum).name and out["step"] == 2
    assert signal.getsignal(signum) is before
    assert latest(tmp_path / "cut") == "step_000002"
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["latest", "step_000002"]
    state = torch.load(tmp_path / "cut/checkpoints/step_000002/state.pt", weights_only=False)
    assert state["step"] == 2
    assert [m["step"] for m in read_metrics(tmp_path / "cut")] == [0, 1, 2]

    out = loop.train(cfg)  # the resubmission
    assert "stopped_on" not in out and out["step"] == 5
    cut = read_metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [0, 1, 2, 3, 4, 5]
    assert latest(tmp_path / "cut") == "step_000005"

    if signum != signal.SIGUSR1:  # the same path; one uninterrupted run to compare with is enough
        return
    full = small_cfg(ckpts, tmp_path / "full")
    full.run.steps, full.run.save_every = 6, 0
    loop.train(full)
    keys = ["reward_mean", "loss", "gen_tokens"]
    assert [[m[k] for k in keys] for m in cut] == [[m[k] for k in keys] for m in read_metrics(tmp_path / "full")]


def test_a_signal_before_the_first_step_stops_without_a_step(ckpts, tmp_path, shaped_reward):
    """SIGUSR1 while the trainer is being built (a job signalled during a long model load): no step runs and
    nothing is saved; the run returns `stopped_on`."""

    def make(cfg):
        trainer = loop.Trainer(cfg)
        os.kill(os.getpid(), signal.SIGUSR1)
        return trainer

    cfg = small_cfg(ckpts, tmp_path)
    assert loop.run(cfg, make) == {"stopped_on": "SIGUSR1"}
    assert not (tmp_path / "checkpoints").exists() and read_metrics(tmp_path) == []


def test_save_every_s_saves_by_the_clock_and_save_every_zero_does_not_divide(ckpts, tmp_path, shaped_reward):
    """An injected clock that moves 40 s per step, `save_every_s=100`, `save_every=0` (no step cadence; it used to
    divide by zero after the first step): saves after step 2 (120 s since the start) and then at the end (step 4,
    80 s after the last save: the end saves whatever the clock says)."""
    now = [0.0]

    class Ticking(loop.Trainer):
        def step(self, step):
            now[0] += 40.0
            return super().step(step)

    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps, cfg.run.save_every, cfg.run.save_every_s = 5, 0, 100.0
    loop.run(cfg, Ticking, clock=lambda: now[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]


def test_save_due_names_why():
    """Which cadence saves after a step, in order: the end, a signal, `save_every` steps, `save_every_s` seconds;
    each save restarts the time cadence."""
    now = [0.0]
    clock = SaveClock(50.0, lambda: now[0])
    stop = StopRequest()
    run = RunSection(save_every=3, save_every_s=50.0)
    assert save_due(0, run, clock, stop.name, last=False) is None
    assert save_due(2, run, clock, stop.name, last=False) == "save_every"
    now[0] = 50.0
    assert save_due(3, run, clock, stop.name, last=False) == "save_every_s"
    clock.saved()
    assert save_due(3, run, clock, stop.name, last=False) is None
    stop.request(signal.SIGTERM)
    assert save_due(3, run, clock, stop.name, last=False) == "SIGTERM"
    assert save_due(3, run, clock, stop.name, last=True) == "end"
    assert not SaveClock(None, lambda: 1e9).due()


def test_pid_file_names_the_process_running_the_loop(tmp_path, monkeypatch):
    """The templates forward SLURM's signal to the process id in `$MEGATRON_SPEC_PID_FILE`, written when the
    handlers are installed; a signal to it sets the flag instead of ending the process."""
    pid_file = tmp_path / "logs" / "driver.pid"
    monkeypatch.setenv("MEGATRON_SPEC_PID_FILE", str(pid_file))
    stop = StopRequest()
    with stop.installed():
        assert pid_file.read_text() == f"{os.getpid()}\n"
        os.kill(int(pid_file.read_text()), signal.SIGUSR1)
        assert stop.requested and stop.name == "SIGUSR1"


@pytest.mark.parametrize("field, value, message", [
    ("save_every", -1, "run.save_every must be >= 0"),
    ("save_every_s", 0, "run.save_every_s must be > 0"),
    ("save_every_s", -5.0, "run.save_every_s must be > 0"),
    ("signal_before_s", -1, "run.signal_before_s must be >= 0"),
    ("eval_every", -2, "run.eval_every must be >= 0"),
    ("async_save_writer", "fork", "run.async_save_writer must be process or thread"),
])
def test_cadence_fields_are_checked_before_any_compute(field, value, message):
    with pytest.raises(ValueError, match=message):
        RunSection(**{field: value})
    with pytest.raises(ValueError, match=message):
        apply_overrides(RLConfig(), [f"run.{field}={value}"])


def test_cadence_overrides_parse():
    cfg = apply_overrides(RLConfig(), ["run.save_every=0", "run.save_every_s=1800", "run.signal_before_s=600"])
    assert (cfg.run.save_every, cfg.run.save_every_s, cfg.run.signal_before_s) == (0, 1800.0, 600)
