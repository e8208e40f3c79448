"""Rewards of a batch of completions, computed in parallel worker processes with a timeout per item.

A reward function is named by import path (`package.module:function`, called as `function(text, answer) ->
float`), so spawned workers import it themselves. Each call runs under a timer of `timeout_s` in its worker
(`signal.setitimer`: a symbolic comparison that runs away is interrupted and scores 0, and is counted); a worker
stuck where the timer cannot reach it is caught by a deadline on the whole batch, after which the pool is
replaced. Workers are spawned (not forked): the trainer's process holds torch's threads. Runs placed on Ray score
with the same contract in Ray actors (`placement/scoring.py`, chosen by `tasks.dataset.make_scorer`).
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable

_RESOLVED: dict[str, Callable] = {}


def resolve(path: str) -> Callable:
    """`package.module:function` -> the function (a clear error for a bad path, before any scoring)."""
    if path not in _RESOLVED:
        module, _, name = path.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward function {path!r} cannot be imported: {err}") from err
        if not callable(fn):
            raise ValueError(f"reward function {path!r} is not callable")
        _RESOLVED[path] = fn
    return _RESOLVED[path]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


_WARM: set[str] = set()
WARM_UP_S = 120.0
"""The bound on a reward function's first call in a process (math-verify builds its parsers there: seconds on a
loaded host, which the per-item timer must not count against a completion)."""


def score_one(path: str, text: str, answer: str, timeout_s: float) -> tuple[float, bool]:
    """(reward, timed out) of one completion; the timer only works in a process's main thread (a worker's, or the
    driver's), elsewhere the call is unbounded. A process's first call for a function warms it up on the answer
    against itself, under a timer of its own."""
    fn = resolve(path)
    if path not in _WARM:
        _WARM.add(path)
        try:
            _timed(fn, answer, answer, max(WARM_UP_S, timeout_s))
        except Exception:  # noqa: BLE001 - only a warm-up: the completion's own call reports what is wrong
            pass
    return _timed(fn, text, answer, timeout_s)


def _timed(fn: Callable, text: str, answer: str, timeout_s: float) -> tuple[float, bool]:
    timed = threading.current_thread() is threading.main_thread()
    if timed:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return float(fn(text, answer)), False
    except _Timeout:
        return 0.0, True
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def spawn_pool(workers: int):
    """A pool of spawned processes that do not run the driver's script: spawn re-imports `__main__` in every worker,
    and a script without a main guard (`if __name__ == "__main__"`) would start the whole job again in each. The
    workers only need the reward function, which they import by name."""
    main = sys.modules["__main__"]
    hidden = {k: main.__dict__.pop(k) for k in ("__file__",) if k in main.__dict__}
    spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        return multiprocessing.get_context("spawn").Pool(workers)
    finally:
        main.__dict__.update(hidden)
        main.__spec__ = spec


class RewardScorer:
    """Scores (text, answer) pairs with the reward function at `path`, in `workers` processes (0: in this one)."""

    def __init__(self, path: str, workers: int = 2, timeout_s: float = 10.0):
        resolve(path)  # a bad path fails here, not in a worker
        self.path, self.workers, self.timeout_s = path, workers, timeout_s
        self.pool = None

    def __call__(self, texts: list[str], answers: list[str]) -> tuple[list[float], int]:
        """(rewards, how many timed out). A reward function that raises is a bug in it: re-raised with the text."""
        if self.workers == 0:
            results = [self._checked(score_one, t, a) for t, a in zip(texts, answers)]
        else:
            results = self._parallel(texts, answers)
        return [r for r, _ in results], sum(t for _, t in results)

    def _checked(self, fn, text, answer):
        try:
            return fn(self.path, text, answer, self.timeout_s)
        except Exception as err:  # noqa: BLE001 - re-raised with the completion that broke it
            raise RuntimeError(f"reward function {self.path} failed on completion {text[:80]!r}: {err}") from err

    def _parallel(self, texts: list[str], answers: list[str]) -> list[tuple[float, bool]]:
        if self.pool is None:
            self.pool = spawn_pool(self.workers)
        jobs = [self.pool.apply_async(score_one, (self.path, t, a, self.timeout_s)) for t, a in zip(texts, answers)]
        # Every call is bounded by its own timer; this deadline only catches a worker the timer cannot interrupt.
        deadline = time.monotonic() + self.timeout_s * (math.ceil(len(jobs) / self.workers) + 1) + 60
        results, stuck = [], False
        for job, text in zip(jobs, texts):
            try:
                results.append(job.get(max(deadline - time.monotonic(), 0)))
            except multiprocessing.TimeoutError:
                results.append((0.0, True))
                stuck = True
            except Exception as err:  # noqa: BLE001 - as in _checked
                raise RuntimeError(f"reward function {self.path} failed on completion {text[:80]!r}: {err}") from err
        if stuck:
            self.close()
        return results

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
