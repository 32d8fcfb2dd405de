"""The engine-facing HTTP client (gateway.workers.upstream) against a scripted local HTTP server.

The server counts connections, so the tests see what the pool did: a connection is reused
only after its response fully arrived, and never after a timeout or an early stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.workers.upstream import UpstreamClient, UpstreamError, UpstreamTimeout

pytestmark = pytest.mark.anyio

SSE = b'data: {"text": "a"}\n\ndata: {"text": "b"}\n\ndata: [DONE]\n\n'


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


class ScriptedServer:
    """Answers each request with what ``respond`` writes; records connections and request bodies."""

    def __init__(self) -> None:
        self.connections = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.respond: Callable[[asyncio.StreamWriter], object] = self.whole_json
        self.hold = asyncio.Event()  # what a hung server waits for (never set unless a test does)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/generate"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self.hold.set()

    async def __aenter__(self) -> ScriptedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,  # a GET
                )
                self.bodies.append(await reader.readexactly(length))
                outcome = self.respond(writer)
                if asyncio.iscoroutine(outcome):
                    await outcome
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def whole_json(writer: asyncio.StreamWriter) -> None:
        body = b'{"text": "ok"}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )

    @staticmethod
    def whole_stream(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(SSE)
        )


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    async with ScriptedServer() as scripted:
        yield scripted


async def post(
    client: UpstreamClient, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    """One whole exchange, made as dispatch makes its own: send, wait for the answer, finish."""
    connection = await client.send(url, body, headers)
    try:
        await client.wait_for_answers((connection,))
        if connection.failure is not None:
            raise connection.failure
        return connection.status, connection.body()
    finally:
        client.finish(connection)


async def _lines_until_done(client: UpstreamClient, url: str) -> list[bytes]:
    lines = client.stream(url, b"{}", {})
    seen = []
    try:
        async for _, batch in lines:
            for line in batch:
                seen.append(line)
                if line == b"data: [DONE]":
                    return seen  # as dispatch does: it stops reading at [DONE]
    finally:
        await lines.aclose()
    return seen


async def test_posts_reuse_one_keep_alive_connection(server: ScriptedServer) -> None:
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    for number in range(3):
        assert await post(client, server.url, b'{"n": %d}' % number, {"X-Test": "1"}) == (
            200,
            b'{"text": "ok"}',
        )
    assert server.connections == 1
    assert server.bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    await client.aclose()


async def test_gets_send_path_and_query_and_reuse_one_keep_alive_connection(
    server: ScriptedServer,
) -> None:
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    for _ in range(3):
        assert await client.get(server.url + "?include=core") == (200, b'{"text": "ok"}')
    assert server.connections == 1
    host = server.url.split("/")[2].encode()
    assert server.heads[0] == b"GET /generate?include=core HTTP/1.1\r\nHost: %s\r\n\r\n" % host
    await client.aclose()


async def test_a_get_on_a_kept_alive_connection_the_server_closed_is_sent_again_on_a_new_one(
    server: ScriptedServer,
) -> None:
    answered = 0

    def answer_once_per_connection(writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        answered += 1
        if answered == 2:  # the second request, on the kept-alive connection: closed unanswered
            writer.close()
            return
        server.whole_json(writer)

    server.respond = answer_once_per_connection
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    assert await client.get(server.url) == (200, b'{"text": "ok"}')
    assert await client.get(server.url) == (200, b'{"text": "ok"}')
    assert server.connections == 2 and answered == 3
    await client.aclose()


async def test_a_get_without_answer_times_out_within_its_own_timeout(
    server: ScriptedServer,
) -> None:
    async def hang(writer: asyncio.StreamWriter) -> None:
        await server.hold.wait()

    server.respond = hang
    client = UpstreamClient(connect_timeout_s=2, timeout_s=60, deadline_resolution_s=0.05)
    with pytest.raises(UpstreamTimeout, match="did not answer in time"):
        await asyncio.wait_for(client.get(server.url, timeout_s=0.2), timeout=5)
    await client.aclose()


async def test_a_stream_read_up_to_done_returns_its_connection_to_the_pool(
    server: ScriptedServer,
) -> None:
    server.respond = server.whole_stream
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    for _ in range(3):
        lines = await _lines_until_done(client, server.url)
        assert lines[-1] == b"data: [DONE]" and b'data: {"text": "b"}' in lines
    assert server.connections == 1
    await client.aclose()


async def test_a_stream_left_before_its_response_ended_is_closed_not_reused(
    server: ScriptedServer,
) -> None:
    async def first_chunk_then_hang(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(SSE), SSE)
        )
        await writer.drain()
        await server.hold.wait()  # the terminating chunk never comes

    server.respond = first_chunk_then_hang
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    assert (await _lines_until_done(client, server.url))[-1] == b"data: [DONE]"
    server.respond = server.whole_json
    # The next request must not read the rest of the abandoned response: a new connection.
    assert await post(client, server.url, b"{}", {}) == (200, b'{"text": "ok"}')
    assert server.connections == 2
    await client.aclose()


async def test_a_post_without_answer_times_out_and_its_connection_is_dropped(
    server: ScriptedServer,
) -> None:
    async def hang(writer: asyncio.StreamWriter) -> None:
        await server.hold.wait()

    server.respond = hang
    client = UpstreamClient(connect_timeout_s=2, timeout_s=0.2)
    with pytest.raises(UpstreamTimeout, match="did not answer in time"):
        await post(client, server.url, b"{}", {})
    server.respond = server.whole_json
    server.hold.set()
    assert await post(client, server.url, b"{}", {}) == (200, b'{"text": "ok"}')
    assert server.connections == 2
    await client.aclose()


async def test_a_stream_that_stalls_mid_response_times_out(server: ScriptedServer) -> None:
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"6\r\ndata: \r\n")
        await writer.drain()
        await server.hold.wait()

    server.respond = stall
    client = UpstreamClient(connect_timeout_s=2, timeout_s=0.2)
    lines = client.stream(server.url, b"{}", {})
    assert await lines.__anext__() == (200, [])
    with pytest.raises(UpstreamTimeout, match="stalled"):
        async for _ in lines:
            pass
    await client.aclose()


async def test_a_connection_closed_mid_response_is_an_upstream_error(
    server: ScriptedServer,
) -> None:
    async def cut(writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"te')
        await writer.drain()
        writer.transport.abort()

    server.respond = cut
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    with pytest.raises(UpstreamError) as raised:
        await post(client, server.url, b"{}", {})
    assert not isinstance(raised.value, UpstreamTimeout)
    await client.aclose()


@pytest.fixture
async def other() -> AsyncIterator[
    ScriptedServer
]:  # a second worker: prefill and decode of one request
    async with ScriptedServer() as scripted:
        yield scripted


async def test_answers_awaited_together_wait_for_both(
    server: ScriptedServer, other: ScriptedServer
) -> None:
    async def late(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)
        server.whole_json(writer)

    other.respond = late
    client = UpstreamClient(connect_timeout_s=2, timeout_s=5)
    first, second = (
        await client.send(server.url, b"{}", {}),
        await client.send(other.url, b"{}", {}),
    )
    await client.wait_for_answers((first, second))
    assert first.answered and second.answered and (first.status, second.status) == (200, 200)
    assert second.body() == b'{"text": "ok"}'
    for connection in (first, second):
        client.finish(connection)
    await post(client, other.url, b"{}", {})
    assert other.connections == 1  # answered in full: pooled and reused
    await client.aclose()


async def test_a_refusal_ends_the_wait_and_the_unanswered_exchange_is_not_reused(
    server: ScriptedServer, other: ScriptedServer
) -> None:
    async def refuse(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}")

    async def hang(writer: asyncio.StreamWriter) -> None:
        await other.hold.wait()  # a decode waiting for a transfer that never comes

    server.respond, other.respond = refuse, hang
    client = UpstreamClient(connect_timeout_s=2, timeout_s=30)
    refused, waiting = (
        await client.send(server.url, b"{}", {}),
        await client.send(other.url, b"{}", {}),
    )
    await asyncio.wait_for(client.wait_for_answers((refused, waiting)), 5)  # not the 30 s timeout
    assert refused.status == 500 and not waiting.answered
    client.finish(refused)
    client.finish(waiting)
    other.respond = other.whole_json
    assert await post(client, other.url, b"{}", {}) == (200, b'{"text": "ok"}')
    assert other.connections == 2
    await client.aclose()


async def test_one_timer_fails_only_what_has_not_answered(
    server: ScriptedServer, other: ScriptedServer
) -> None:
    async def hang(writer: asyncio.StreamWriter) -> None:
        await other.hold.wait()

    other.respond = hang
    client = UpstreamClient(connect_timeout_s=2, timeout_s=0.3)
    answered, hung = (
        await client.send(server.url, b"{}", {}),
        await client.send(other.url, b"{}", {}),
    )
    await client.wait_for_answers((answered, hung))
    assert answered.failure is None and answered.status == 200
    assert isinstance(hung.failure, UpstreamTimeout)
    await client.aclose()
