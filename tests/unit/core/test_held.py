"""``Held``: what a request holds is released once, last first, on every exit path; a stream
takes it over whole."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.held import Held


def test_releases_run_last_pushed_first_and_async_ones_are_awaited() -> None:
    order: list[str] = []

    async def lease_release() -> None:
        await asyncio.sleep(0)
        order.append("lease")

    async def main() -> None:
        async with Held() as held:
            held.push(lease_release)
            held.push(lambda: order.append("slot"))
            held.push(lambda: order.append("claim"))
            assert order == []

    asyncio.run(main())
    assert order == ["claim", "slot", "lease"]


def test_a_failing_release_does_not_keep_the_others_and_its_error_is_raised() -> None:
    released: list[str] = []

    def broken() -> None:
        raise RuntimeError("release failed")

    async def cancelled() -> None:
        raise asyncio.CancelledError

    async def main() -> None:
        held = Held()
        held.push(lambda: released.append("first"))
        held.push(cancelled)
        held.push(broken)
        held.push(lambda: released.append("last"))
        with pytest.raises(RuntimeError, match="release failed"):
            await held.aclose()

    asyncio.run(main())
    assert released == ["last", "first"]


def test_the_body_error_comes_out_once_everything_is_released() -> None:
    released: list[str] = []

    async def main() -> None:
        with pytest.raises(ValueError, match="refused"):
            async with Held() as held:
                held.push(lambda: released.append("claim"))
                raise ValueError("refused")

    asyncio.run(main())
    assert released == ["claim"]


def test_pop_all_hands_everything_over_and_the_old_holder_releases_nothing() -> None:
    released: list[str] = []

    async def main() -> None:
        async with Held() as held:
            held.push(lambda: released.append("claim"))
            taken = held.pop_all()
        assert released == []  # the request's own close released nothing
        await taken.aclose()
        await taken.aclose()  # a second close releases nothing twice

    asyncio.run(main())
    assert released == ["claim"]
