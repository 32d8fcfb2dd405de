"""Deadlines of long-lived objects (connections), checked together a few times a second.

The problem: every request moves its connections through several deadlines: the client's
headers, its body, keep-alive until its next request, each worker's answer, each streamed
chunk. An event-loop timer armed and cancelled for each costs far more than the rest of such
a step, and a request takes several.

The invariant: an object that is watched and whose ``deadline`` (on the loop's clock) has
passed has its deadline reset to ``NEVER`` and then ``deadline_passed()`` called, once, at most
``resolution_s`` late. Storing a time in ``deadline`` is all it takes to arm, move or disarm one
(``NEVER``). One timer per sweep runs while anything is watched, and none while nothing is.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

NEVER = math.inf
# How late a deadline may be acted on, unless the caller says otherwise (the settings do).
DEFAULT_RESOLUTION_S = 0.1


class Expiring(Protocol):
    deadline: float

    def deadline_passed(self) -> None: ...


class DeadlineSweep:
    """The watched objects of one event loop and the timer that checks their deadlines."""

    def __init__(self, resolution_s: float = DEFAULT_RESOLUTION_S) -> None:
        self.resolution_s = resolution_s
        self._watched: set[Expiring] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, item: Expiring, loop: asyncio.AbstractEventLoop) -> None:
        """Check ``item``'s deadline from now on, on ``loop`` (the running loop)."""
        self._watched.add(item)
        if self._timer is None or self._loop is not loop:  # a new loop: tests run several
            self._loop = loop
            self._timer = loop.call_later(self.resolution_s, self._sweep)

    def unwatch(self, item: Expiring) -> None:
        self._watched.discard(item)

    def _sweep(self) -> None:
        loop = self._loop
        assert loop is not None  # ``watch`` set it before the first sweep
        now = loop.time()
        for item in [item for item in self._watched if item.deadline <= now]:
            item.deadline = NEVER
            item.deadline_passed()
        self._timer = loop.call_later(self.resolution_s, self._sweep) if self._watched else None

    def __reduce__(self) -> tuple[type[DeadlineSweep], tuple[float]]:
        # A server's protocol factory is pickled for each worker process: a fresh sweep each.
        return (DeadlineSweep, (self.resolution_s,))
