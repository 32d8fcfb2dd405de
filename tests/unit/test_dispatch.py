"""The prefill/decode race: both answers are awaited, but the first failure ends the wait."""

from __future__ import annotations

import asyncio

from gateway.dispatch import _both_or_first_failure


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_the_join_waits_for_both_answers() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        prefill, decode = loop.create_future(), loop.create_future()
        joined = _both_or_first_failure(prefill, decode)
        prefill.set_result({"prefill": "ok"})
        await _settle()
        assert not joined.done()  # decode is still generating
        decode.set_result({"text": "hi"})
        await asyncio.wait_for(joined, 1)

    asyncio.run(scenario())


def test_a_failure_ends_the_wait_while_the_other_still_runs() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        prefill, decode = loop.create_future(), loop.create_future()
        joined = _both_or_first_failure(prefill, decode)
        prefill.set_exception(RuntimeError("prefill failed"))
        await asyncio.wait_for(joined, 1)  # decode (waiting for a transfer) is not awaited
        assert not decode.done()
        decode.set_result({})  # a late answer after the join is harmless

    asyncio.run(scenario())


def test_a_cancelled_side_ends_the_wait() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        prefill, decode = loop.create_future(), loop.create_future()
        joined = _both_or_first_failure(prefill, decode)
        decode.cancel()
        await asyncio.wait_for(joined, 1)

    asyncio.run(scenario())
