"""How often another task got the event loop while a piece of work ran: work that holds the loop
in one go lets none run; work sliced with the loop free between slices lets one run per gap."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def with_turns(work: Awaitable[T]) -> tuple[T, int]:
    """What ``work`` returns (run in a fresh loop), and how many times another task ran while
    it did."""

    async def run() -> tuple[T, int]:
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
            return await work, turns
        finally:
            done = True
            await other

    return asyncio.run(run())
