"""How late the event loop runs: one task that sleeps a short interval and records how much
later than asked it woke.

Whatever holds the loop (a body parsed, a schema validated, a prompt tokenized on it) delays
every request of every tenant this process serves by as long, and nothing else in the gateway
sees it. The probe's wake-ups go to ``Metrics.loop_lag`` (the ``isogate_event_loop_lag_*``
series); the fuzzing tests read them after every case. A wake-up is late by at least the time
the loop was held, less one interval (the hold may begin just after a wake-up), so the interval
is short; a wake-up is a timer and a subtraction, nothing per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

PROBE_INTERVAL_S = 0.02


class LoopLagProbe:
    """Sleeps ``interval_s`` again and again on the running loop and passes each wake-up's
    lateness (seconds, never negative) to ``observe``; runs until cancelled."""

    def __init__(
        self, observe: Callable[[float], None], *, interval_s: float = PROBE_INTERVAL_S
    ) -> None:
        self._observe = observe
        self._interval_s = interval_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)
            # The loop may run a timer up to its clock's resolution early: not negative lag.
            self._observe(max(0.0, loop.time() - due))
