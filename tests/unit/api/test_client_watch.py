"""``ClientWatch``: a client that leaves cancels the work serving it, by the connection's hook
under the gateway's own server and by a watcher task under any other ASGI server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from gateway.api.pipeline import ClientWatch
from gateway.server.http_server import DISCONNECT_EXTENSION, DisconnectHook


def _scope(hook: DisconnectHook | None) -> dict[str, Any]:
    scope: dict[str, Any] = {"type": "http"}
    if hook is not None:
        scope["extensions"] = {DISCONNECT_EXTENSION: {"hook": hook}}
    return scope


async def _never_receive() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def test_the_hook_calling_back_cancels_the_work_and_comes_out_as_client_disconnect() -> None:
    async def main() -> None:
        hook = DisconnectHook()
        loop = asyncio.get_running_loop()

        async def serve() -> None:
            with ClientWatch(_scope(hook), _never_receive):
                assert hook.callback is not None
                loop.call_later(0.01, hook.callback)
                await asyncio.sleep(10)

        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(serve(), 5)
        assert hook.callback is None  # let go of on the way out

    asyncio.run(main())


def test_a_client_already_gone_is_refused_before_any_work() -> None:
    async def main() -> None:
        hook = DisconnectHook()
        hook.gone = True
        worked = False
        with pytest.raises(ClientDisconnect), ClientWatch(_scope(hook), _never_receive):
            worked = True
        assert not worked

    asyncio.run(main())


def test_work_that_ends_before_the_client_leaves_is_not_touched_afterwards() -> None:
    async def main() -> None:
        hook = DisconnectHook()
        with ClientWatch(_scope(hook), _never_receive):
            pass
        assert hook.callback is None
        await asyncio.sleep(0.01)  # nothing left behind to cancel this task later

    asyncio.run(main())


def test_without_the_hook_a_watcher_task_notices_the_disconnect() -> None:
    async def main() -> None:
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def serve() -> None:
            with ClientWatch(_scope(None), receive):
                asyncio.get_running_loop().call_later(0.01, gone.set)
                await asyncio.sleep(10)

        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(serve(), 5)

    asyncio.run(main())
