"""What holding a request's claims costs: ``contextlib.AsyncExitStack`` against ``core.held``.

Why ``gateway.core.held.Held`` exists instead of the library: a request pushes three releases (the
limits lease, async; the queue slot and the KV claim, plain) and closes them once. This times
exactly that, the two holders interleaved in every round, in one process, and prints the
median µs per request of each and their ratio. The whole-gateway figure is
``bench.instructions`` with the two checkouts (bench/RESULTS.md).

    .venv/bin/python -m bench.held_bench [--rounds 7] [--requests 50000]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from bench import side_by_side
from gateway.core.held import Held


def _plain_release() -> None:
    pass


async def _async_release() -> None:
    pass


async def _one_request(
    close: Callable[[], Awaitable[None]],
    push_async: Callable[[Callable[[], Awaitable[None]]], object],
    push: Callable[[Callable[[], None]], object],
) -> None:
    try:
        push_async(_async_release)  # the limits lease
        push(_plain_release)  # the queue slot
        push(_plain_release)  # the KV claim
    finally:
        await close()


async def _with_exit_stack() -> None:
    held = AsyncExitStack()
    await _one_request(held.aclose, held.push_async_callback, held.callback)


async def _with_held() -> None:
    held = Held()
    await _one_request(held.aclose, held.push, held.push)


async def _us_per_request(one: object, requests: int) -> float:
    assert callable(one)
    started = time.perf_counter()
    for _ in range(requests):
        await one()
    return (time.perf_counter() - started) / requests * 1e6


async def measure(rounds: int, requests: int) -> dict[str, float]:
    stack: list[float] = []
    held: list[float] = []
    for _ in range(rounds):
        stack.append(await _us_per_request(_with_exit_stack, requests))
        held.append(await _us_per_request(_with_held, requests))
    a, b = statistics.median(stack), statistics.median(held)
    return {"async_exit_stack_us": round(a, 3), "held_us": round(b, 3), "ratio": round(a / b, 2)}


def main(argv: list[str] | None = None) -> int:
    return side_by_side.run(
        argv, __doc__, "--requests", 50_000, lambda r, n: asyncio.run(measure(r, n))
    )


if __name__ == "__main__":
    raise SystemExit(main())
