"""The gateway's HTTP/1.1 protocol (``gateway.server.http_server``) under uvicorn, in process, read
off a raw socket: a whole answer's head and body as uvicorn would write them, the connection
kept alive or closed as asked, and anything off the fast path left to uvicorn's own checks."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.server.http_server import (
    HEADER_LINES_EXTENSION,
    ClientBounds,
    bounded_protocol,
    header_lines_offered,
)

pytestmark = pytest.mark.anyio

_BOUNDS = ClientBounds(
    header_timeout_s=30, body_timeout_s=30, max_header_bytes=16384, max_connections=16
)


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    body = b'{"ok": true}'
    if path == "/whole":
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-ratelimit-remaining-requests", b"59"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif path == "/parts":  # a declared length, sent in two messages
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:4], "more_body": True})
        await send({"type": "http.response.body", "body": body[4:]})
    elif path == "/stream":  # no length: chunked, by uvicorn
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await send({"type": "http.response.body", "body": b"cd"})
    elif path.startswith("/injected/"):  # a header that would start a header of its own
        name, value = {
            "/injected/value": (b"x-note", b"a\r\nset-cookie: x=1"),
            "/injected/name": (b"set-cookie: x=1\r\nx-note", b"a"),
        }[path]
        headers = [(b"content-length", b"2"), (name, value)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/upper":  # a name not in lower case: uvicorn's path, which lowers it
        headers = [(b"Content-Length", b"2"), (b"X-Note", b"caf\xc3\xa9\tok")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path.startswith("/stream-lines"):  # a stream's head as lines, then chunks (or none)
        assert header_lines_offered(scope)
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send({**start, HEADER_LINES_EXTENSION: b"x-generation-id: gen_1\r\n"})
        if path == "/stream-lines":
            await send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path.startswith("/lines"):  # header lines the app made itself, if the server takes them
        assert header_lines_offered(scope)
        lines = b"content-length: 2\r\nx-ratelimit-remaining-requests: 59\r\n"
        # A name not in lower case: uvicorn's path, which must still write the lines.
        headers = [(b"X-Note", b"a")] if path == "/lines/upper" else [(b"x-note", b"a")]
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        await send({**start, HEADER_LINES_EXTENSION: lines})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/headers":  # the request's headers as the app sees them
        seen = b"\n".join(b"%s=%s" % pair for pair in scope["headers"])
        headers = [(b"content-length", b"%d" % len(seen))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": seen})
    elif path == "/short":  # fewer bytes than declared
        headers = [(b"content-length", b"10")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def server_port() -> AsyncIterator[int]:
    # Listening before the server runs: connections wait in the backlog until it accepts.
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    config = uvicorn.Config(
        _app,
        http=bounded_protocol(_BOUNDS),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        date_header=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[listening]))
    try:
        yield listening.getsockname()[1]
    finally:
        server.should_exit = True
        await serving
        listening.close()


@contextlib.asynccontextmanager
async def _connection(
    port: int,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _exchange(port: int, *paths: str, close: bool = False) -> bytes:
    """Each path's request on one connection (the last asks to close), then all that was read
    until the server closed it."""
    async with _connection(port) as (reader, writer):
        for index, path in enumerate(paths):
            last = index == len(paths) - 1
            connection = b"connection: close\r\n" if close and last else b""
            writer.write(b"GET %s HTTP/1.1\r\nhost: t\r\n%s\r\n" % (path.encode(), connection))
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=10) if close else b""


async def _read_exactly(port: int, path: str) -> tuple[bytes, bool]:
    """One request's answer, and whether the server then closed without another byte."""
    async with _connection(port) as (reader, writer):
        writer.write(b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % path.encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=10)
        return data, reader.at_eof()


async def test_a_whole_answer_is_written_as_uvicorn_writes_it_and_keeps_the_connection(
    server_port: int,
) -> None:
    data = await _exchange(server_port, "/whole", "/whole", close=True)
    first, second = data.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert first == (
        b"content-type: application/json\r\ncontent-length: 12\r\n"
        b"x-ratelimit-remaining-requests: 59\r\n\r\n"
        b'{"ok": true}'
    )
    # The second answer came on the same connection, which it then closed as asked.
    assert second.startswith(b"content-type: application/json\r\ncontent-length: 12\r\n")
    assert b"connection: close\r\n" in second and second.endswith(b'{"ok": true}')


async def test_a_name_in_upper_case_is_written_by_uvicorn_in_lower_case(server_port: int) -> None:
    data = await _exchange(server_port, "/upper", close=True)
    assert data.endswith(
        b"content-length: 2\r\nx-note: caf\xc3\xa9\tok\r\nconnection: close\r\n\r\nok"
    )


async def test_a_body_in_parts_and_a_stream_are_written_by_uvicorn(server_port: int) -> None:
    parts = await _exchange(server_port, "/parts", close=True)
    assert parts.endswith(b'\r\n\r\n{"ok": true}') and b"content-length: 12" in parts
    stream = await _exchange(server_port, "/stream", close=True)
    assert b"transfer-encoding: chunked" in stream
    assert stream.endswith(b"2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")


@pytest.mark.parametrize("part", ["value", "name"])
async def test_a_header_holding_a_line_break_is_never_written(server_port: int, part: str) -> None:
    data, closed = await _read_exactly(server_port, f"/injected/{part}")
    assert b"set-cookie" not in data and closed


async def test_an_answer_shorter_than_its_length_closes_the_connection(server_port: int) -> None:
    data, closed = await _read_exactly(server_port, "/short")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-length: 10" in head and len(body) < 10 and closed


async def test_header_names_reach_the_app_in_lower_case_and_values_without_trailing_space(
    server_port: int,
) -> None:
    async with _connection(server_port) as (reader, writer):
        writer.write(b"GET /headers HTTP/1.1\r\nHost: t\r\nX-Note: a b \t\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        assert await reader.readexactly(length) == b"host=t\nx-note=a b"


@pytest.mark.parametrize("expect", [b"100-continue", b"100-Continue"])
async def test_a_client_that_expects_100_continue_is_told_to_send_its_body(
    server_port: int, expect: bytes
) -> None:
    async with _connection(server_port) as (reader, writer):
        writer.write(
            b"POST /whole HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\nExpect: %s\r\n\r\n" % expect
        )
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_a_client_that_expects_nothing_gets_no_interim_answer(server_port: int) -> None:
    async with _connection(server_port) as (reader, writer):
        writer.write(b"POST /whole HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_header_lines_the_app_made_are_written_after_its_headers(server_port: int) -> None:
    data = await _exchange(server_port, "/lines", close=True)
    assert data == (
        b"HTTP/1.1 200 OK\r\nx-note: a\r\ncontent-length: 2\r\n"
        b"x-ratelimit-remaining-requests: 59\r\nconnection: close\r\n\r\nok"
    )


async def test_header_lines_reach_uvicorns_path_as_headers(server_port: int) -> None:
    data = await _exchange(server_port, "/lines/upper", close=True)
    head, _, body = data.partition(b"\r\n\r\n")
    assert body == b"ok"
    assert b"\r\nx-note: a\r\n" in head and b"\r\ncontent-length: 2\r\n" in head
    assert b"\r\nx-ratelimit-remaining-requests: 59\r\n" in head + b"\r\n"


async def test_a_stream_whose_head_is_lines_is_chunked_as_uvicorn_chunks_it(
    server_port: int,
) -> None:
    data = await _exchange(server_port, "/stream-lines", "/stream-lines/empty", close=True)
    first, second = data.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert first == (
        b"x-generation-id: gen_1\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"
    )
    # A stream without a byte still ends as a chunked body must, and the connection then
    # closes as asked.
    assert second == (
        b"x-generation-id: gen_1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n"
        b"\r\n0\r\n\r\n"
    )


def test_the_gateway_cycle_is_made_with_uvicorns_parameters_in_their_order() -> None:
    """``_start_cycle`` passes uvicorn's cycle its arguments by position (a class called with
    keywords costs a dict per request): a uvicorn that reorders them must fail here, not mix up
    two flags of one type at run time."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    parameters = list(inspect.signature(RequestResponseCycle.__init__).parameters)
    assert parameters == [
        "self",
        "scope",
        "transport",
        "flow",
        "logger",
        "access_logger",
        "access_log",
        "default_headers",
        "message_event",
        "expect_100_continue",
        "keep_alive",
        "on_response",
    ]
