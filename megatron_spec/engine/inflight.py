"""In-flight refits: a refit asked for from another thread while the engine generates is taken between two of its
steps, so the caller never waits for the rest of the generation, only for the step running when it asked.

One condition orders every weight change against every step: a refit asked for while no generation runs is applied
at once in the caller's thread (a generation that starts meanwhile waits for it), one asked for during a generation
is handed to the generating thread, which takes it at its next step boundary (`LLMEngine.generate`) or, if that
generation ends first, as it ends. The caller waits until the weights are in place in either case.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _Request:
    load: Callable[[], Any]
    version: int
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class RefitHandoff:
    """One engine's refits asked for from other threads, and whether it is generating (see the module's text)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.generating = False
        self.request: _Request | None = None

    @property
    def due(self) -> bool:
        """A refit waits for the next step boundary (read by the generating thread once a step)."""
        return self.request is not None

    def refit(self, engine, load: Callable[[], Any], version: int):
        """From any thread: `engine.refit(load, version)` now if no generation runs, else at the generation's next
        step boundary; returns what `load` returned once the weights are in place."""
        with self.cond:
            if not self.generating:
                return engine.refit(load, version)
            if self.request is not None:
                raise RuntimeError("a second in-flight refit was asked for before the first was taken")
            request = self.request = _Request(load, version)
            while not request.done:
                self.cond.wait()
        if request.error is not None:
            raise request.error
        return request.result

    @contextmanager
    def generating_in(self, engine):
        """Around a generation: refits asked for meanwhile are handed over; one still waiting at its end is taken."""
        with self.cond:
            self.generating = True
        try:
            yield
        finally:
            with self.cond:
                self.generating = False
                self._take(engine)

    def take(self, engine) -> None:
        """In the generating thread, between two steps: apply the refit waiting, if any."""
        with self.cond:
            self._take(engine)

    def _take(self, engine) -> None:
        request, self.request = self.request, None
        if request is None:
            return
        try:
            request.result = engine.refit(request.load, request.version)
        except BaseException as err:  # noqa: BLE001  (the thread that asked raises it too)
            request.error = err
        request.done = True
        self.cond.notify_all()
        if request.error is not None:  # weights half loaded: the generation must not go on with them
            raise request.error
