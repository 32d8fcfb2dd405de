"""What a deadline costs a request: an event-loop timer armed and cancelled, against a deadline
stored for ``gateway.common.deadlines.DeadlineSweep`` to check.

Why the sweep exists instead of the loop's own timers: a request arms and disarms several
deadlines (its headers, keep-alive until the next request, each worker's answer, each streamed
chunk). This times one of them both ways on uvloop, the two interleaved in every round, in one
process, and prints the median ns per deadline of each and their ratio. The sweep's own timer
runs a few times a second whatever the load; it is not in the figure. The whole-gateway figure
is ``bench.instructions`` with the two checkouts (bench/RESULTS.md).

    .venv/bin/python -m bench.timer_bench [--rounds 7] [--deadlines 200000]
"""

from __future__ import annotations

import asyncio
import statistics
import time

import uvloop

from bench import side_by_side
from gateway.common.deadlines import NEVER, DeadlineSweep


class _Connection:
    def __init__(self) -> None:
        self.deadline = NEVER

    def deadline_passed(self) -> None:
        pass


def _never() -> None:
    pass


def _ns_with_loop_timer(loop: asyncio.AbstractEventLoop, deadlines: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(deadlines):
        loop.call_later(10.0, _never).cancel()
    return (time.perf_counter_ns() - started) / deadlines


def _ns_with_sweep(loop: asyncio.AbstractEventLoop, deadlines: int) -> float:
    connection = _Connection()
    sweep = DeadlineSweep()
    sweep.watch(connection, loop)
    started = time.perf_counter_ns()
    for _ in range(deadlines):
        connection.deadline = loop.time() + 10.0
        connection.deadline = NEVER
    elapsed = time.perf_counter_ns() - started
    sweep.unwatch(connection)
    return elapsed / deadlines


async def measure(rounds: int, deadlines: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    stamps: list[float] = []
    for _ in range(rounds):
        timers.append(_ns_with_loop_timer(loop, deadlines))
        stamps.append(_ns_with_sweep(loop, deadlines))
    a, b = statistics.median(timers), statistics.median(stamps)
    return {
        "loop_timer_ns": round(a, 1),
        "sweep_deadline_ns": round(b, 1),
        "ratio": round(a / b, 1),
    }


def main(argv: list[str] | None = None) -> int:
    return side_by_side.run(
        argv, __doc__, "--deadlines", 200_000, lambda r, n: uvloop.run(measure(r, n))
    )


if __name__ == "__main__":
    raise SystemExit(main())
