"""When the loop saves beside `run.save_every`: on a signal, and when `run.save_every_s` seconds have passed.

A SLURM job asks for SIGUSR1 some minutes before its time limit (`run.signal_before_s`; the sbatch templates forward
it to the process that runs the loop, whose id they read from `$MEGATRON_SPEC_PID_FILE`). SIGTERM, which SLURM
sends at the limit itself and on `scancel`, counts the same. The handler only sets a flag: the step in flight
finishes, the loop saves a checkpoint at that step boundary (the usual atomic save, collective for the Megatron
trainer because rank 0 announces it) and returns, and the process exits 0. A resubmission resumes from that
checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
"""What asks the loop to save and stop at the next step boundary."""
PID_FILE_ENV = "MEGATRON_SPEC_PID_FILE"
"""Where the sbatch templates look for the id of the process to forward SLURM's signal to (this one writes it)."""


class StopRequest:
    """Set by a signal handler (or by `request`), read by the loop at each step boundary."""

    def __init__(self):
        self.signum: int | None = None

    def request(self, signum: int, frame=None) -> None:
        self.signum = signum  # nothing else here: a handler runs between any two bytecodes of the step

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @contextmanager
    def installed(self):
        """Handle `SIGNALS` while the loop runs (restoring the earlier handlers after), and write this process's id
        where `$MEGATRON_SPEC_PID_FILE` says. Outside the main thread Python cannot install handlers: the loop then
        runs without them (a test driving it from a thread calls `request` itself)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.request) for s in SIGNALS}
        pid_file = os.environ.get(PID_FILE_ENV)
        if pid_file:
            Path(pid_file).parent.mkdir(parents=True, exist_ok=True)
            Path(pid_file).write_text(f"{os.getpid()}\n")
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class SaveClock:
    """`run.save_every_s`: due once that many seconds have passed since the last save (or the loop's start).
    `clock` is injectable for tests (default `time.monotonic`)."""

    def __init__(self, every_s: float | None, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last = clock()

    def due(self) -> bool:
        return self.every_s is not None and self.clock() - self.last >= self.every_s

    def saved(self) -> None:
        self.last = self.clock()


def save_due(step: int, run, clock: SaveClock, signalled: str, last: bool) -> str | None:
    """Why the loop saves after `step` (None: it does not): the end, a signal (`signalled`: its name, read once at
    this boundary), `save_every` steps, `save_every_s` seconds."""
    if last:
        return "end"
    if signalled:
        return signalled
    if run.save_every and (step + 1) % run.save_every == 0:
        return "save_every"
    if clock.due():
        return "save_every_s"
    return None
