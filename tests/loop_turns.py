"""How often another task got the event loop while a piece of work ran: work that holds the loop
in one go lets none run; work sliced with the loop free between slices lets one run per gap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def with_turns(work: Awaitable[T]) -> tuple[T, int]:
    """What ``work`` returns (run in a fresh loop), and how many times another task ran while
    it did."""

    async def run(turns: Callable[[], int]) -> tuple[T, int]:
        return await work, turns()

    return asyncio.run(_beside_another_task(run))


def items_with_turns(items: AsyncIterable[T]) -> list[tuple[T, int]]:
    """Each item of ``items`` (iterated in a fresh loop), with how many times another task had
    run by the time it came."""

    async def run(turns: Callable[[], int]) -> list[tuple[T, int]]:
        return [(item, turns()) async for item in items]

    return asyncio.run(_beside_another_task(run))


async def _beside_another_task(run: Callable[[Callable[[], int]], Awaitable[T]]) -> T:
    """``run(turns)`` while another task counts its turns of the loop (``turns()``)."""
    turns = 0
    done = False

    async def other_tenant() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_tenant())
    await asyncio.sleep(0)
    turns = 0
    try:
        return await run(lambda: turns)
    finally:
        done = True
        await other
