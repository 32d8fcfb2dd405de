"""A lean keep-alive HTTP/1.1 client for the engine hot path (``/generate`` to SGLang workers).

Why not httpx here: per request, httpx/httpcore walk every pooled connection and poll its
socket (``has_expired`` → ``is_socket_readable``), and go through anyio streams, cancel scopes
and header models; profiled, that was most of the gateway's CPU per request, and it grows
with the number of pooled connections. This client keeps idle connections per origin in a
list, learns that a peer closed one from ``connection_lost`` (no syscall per request), and
parses with ``httptools`` (already installed with ``uvicorn[standard]``).

Only what dispatch needs: POST with a body, then either await whole answers, several together
(``send``, ``wait_for_answers``, ``finish``: prefill and decode wait that way, with no task per
request), or read one answer as it streams (``stream``); and a GET of a whole answer (``get``:
the capacity poller's, every second per worker, where httpx cost several times the answer's use).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

from gateway.common.deadlines import DEFAULT_RESOLUTION_S, NEVER, DeadlineSweep

log = logging.getLogger(__name__)


class Origin(NamedTuple):
    host: str
    port: int
    tls: bool


class UpstreamError(Exception):
    """The connection failed, closed early, or sent something that is not HTTP."""


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamConnection(asyncio.Protocol):
    """One pooled HTTP/1.1 connection to a worker, carrying one exchange at a time.

    What the dispatcher reads of an exchange: ``done`` (the answer is complete or failed),
    ``answered``, ``complete``, ``failure``, ``status`` and ``body()``. Made by the event loop
    (``create_connection``), so a loop is running; ``begin`` gives each exchange futures of its
    own, and until the first one the futures are pending (no answer before a request).
    """

    def __init__(self, origin: Origin, sweep: DeadlineSweep) -> None:
        self.origin = origin
        self._sweep = sweep
        # While an answer (or the next streamed chunk) is awaited: when it is due (the loop's
        # clock), checked by the client's sweep; what the timeout will say.
        self.deadline = NEVER
        self._overdue = ""
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.keep_alive = False
        self._loop = loop = asyncio.get_running_loop()
        self.headers_done: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        # The whole response has arrived (so the connection may carry the next request): set
        # as it completes, read for every exchange (no one cancels ``done`` or fails it after).
        self.complete = False
        self.chunks: collections.deque[bytes] = collections.deque()
        # Set when body data arrives, the message completes or the connection fails.
        self.readable: asyncio.Future[None] | None = None

    # -- protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's is not an ``asyncio.Transport`` subclass).
        self.transport = cast(asyncio.Transport, transport)
        self._sweep.watch(self, self._loop)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"invalid HTTP from upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._sweep.unwatch(self)
        self._fail(UpstreamError("upstream closed the connection"))

    # -- httptools --
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.deadline = NEVER  # nothing more is awaited of this exchange
        self.keep_alive = self.parser.should_keep_alive()
        if not self.done.done():
            self.done.set_result(None)
            self.complete = True
        self._wake()

    # -- use --
    def begin(self, request: bytes) -> None:
        loop = self._loop
        self.status, self.keep_alive, self.complete = 0, False, False
        self.headers_done, self.done = loop.create_future(), loop.create_future()
        self.chunks.clear()
        self.readable = None
        assert self.transport is not None
        self.transport.write(request)

    def due_within(self, timeout_s: float, message: str) -> None:
        """What is awaited next must come within ``timeout_s``, or the exchange fails with
        ``UpstreamTimeout(message)``; ``deadline = NEVER`` once it came."""
        self.deadline = self._loop.time() + timeout_s
        self._overdue = message

    def deadline_passed(self) -> None:
        """The sweep's call: fail whatever waits on this connection; it is not reused after."""
        self._fail(UpstreamTimeout(self._overdue))
        self.close()

    def _fail(self, exc: Exception) -> None:
        for future in (self.headers_done, self.done):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" log when nobody waits
        self._wake()

    def _wake(self) -> None:
        if self.readable is not None and not self.readable.done():
            self.readable.set_result(None)

    @property
    def answered(self) -> bool:
        """The answer arrived or the exchange failed: nothing more to wait for."""
        return self.done.done()

    @property
    def failure(self) -> BaseException | None:
        """Why the exchange failed (transport, timeout), once answered; None if it did not."""
        return self.done.exception()

    def body(self) -> bytes:
        return b"".join(self.chunks)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _target(url: str, method: str = "POST") -> tuple[Origin, bytes]:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    origin = Origin(parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return origin, f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("latin-1")


class UpstreamClient:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        timeout_s: float,
        max_idle_per_origin: int = 512,
        deadline_resolution_s: float = DEFAULT_RESOLUTION_S,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._max_idle = max_idle_per_origin
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        # URL → (origin, request line and Host header): parsed once per URL, not per request.
        self._targets: dict[str, tuple[Origin, bytes]] = {}
        # URL → (origin, the whole GET request).
        self._gets: dict[str, tuple[Origin, bytes]] = {}
        self._tls = ssl.create_default_context()
        # Every connection's deadline (an answer, a chunk) on one timer (``common.deadlines``).
        self._sweep = DeadlineSweep(deadline_resolution_s)

    def _pooled(self, origin: Origin) -> UpstreamConnection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        log.debug("new upstream connection", extra={"origin": f"{origin.host}:{origin.port}"})
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: UpstreamConnection(origin, self._sweep),
                    origin.host,
                    origin.port,
                    ssl=self._tls if origin.tls else None,
                )
        except TimeoutError as exc:
            raise UpstreamTimeout("connect timed out") from exc
        except OSError as exc:
            raise UpstreamError(f"connect failed: {exc}") from exc
        return connection

    def finish(self, connection: UpstreamConnection) -> None:
        """Done with an exchange: its connection is pooled if the whole answer arrived, else
        closed (the rest of an abandoned answer must never be read as the next request's)."""
        if connection.complete:
            self._release(connection.origin, connection)
        else:
            connection.close()

    def _release(self, origin: Origin, connection: UpstreamConnection) -> None:
        idle = self._idle.setdefault(origin, [])
        if connection.keep_alive and not connection.closed and len(idle) < self._max_idle:
            idle.append(connection)
        else:
            connection.close()

    def _request(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[Origin, bytes]:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        origin, request_line = target
        # Each line joined by str.join over a map (no generator resuming per header, no
        # comprehension frame, no format string parsed per line); the length's line last, so
        # the lines are never none.
        head = "\r\n".join([*map(": ".join, headers.items()), f"Content-Length: {len(body)}"])
        return origin, b"".join((request_line, head.encode("latin-1"), b"\r\n\r\n", body))

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamConnection:
        """Send a POST; its answer arrives on the returned connection (``wait_for_answers``).
        Hand the connection to ``finish`` when done with it, whatever happened."""
        origin, raw = self._request(url, body, headers)
        # A pooled connection without a coroutine of its own: this runs twice per request.
        connection = self._pooled(origin) or await self._connect(origin)
        connection.begin(raw)
        return connection

    async def get(self, url: str, timeout_s: float | None = None) -> tuple[int, bytes]:
        """A GET's status and whole body, within ``timeout_s`` (the client's timeout if None);
        raises ``UpstreamError`` if the connection fails or the answer is late."""
        target = self._gets.get(url)
        if target is None:
            origin, request_line = _target(url, "GET")
            target = self._gets[url] = (origin, request_line + b"\r\n")
        origin, raw = target
        pooled = self._pooled(origin)
        if pooled is not None:
            try:
                return await self._get_on(pooled, raw, timeout_s)
            except UpstreamTimeout:
                raise
            except UpstreamError:
                # A kept-alive connection the worker closed as it was reused (its idle
                # timeout): a GET may be sent again, on a new connection.
                pass
        return await self._get_on(await self._connect(origin), raw, timeout_s)

    async def _get_on(
        self, connection: UpstreamConnection, request: bytes, timeout_s: float | None
    ) -> tuple[int, bytes]:
        try:
            connection.begin(request)
            await self._wait(
                connection, connection.done, "upstream did not answer in time", timeout_s
            )
            return connection.status, connection.body()
        finally:
            self.finish(connection)

    async def wait_for_answers(self, connections: Sequence[UpstreamConnection]) -> None:
        """Until every answer has arrived, or one failed or came with a status other than 200.

        Why stop at the first bad answer: prefill and decode of one request wait on each other
        (decode waits for prefill's KV transfer), so once one has failed the other may never
        answer. They are all due by one deadline: once it passed, whatever has not answered
        fails with ``UpstreamTimeout``.
        """
        joined: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_answer(_: object = None) -> None:
            # A plain loop over the futures: this runs for every answer of every request.
            if joined.done():
                return
            waiting = False
            for c in connections:
                done = c.done
                if not done.done():
                    waiting = True
                elif done.exception() is not None or c.status != 200:
                    joined.set_result(None)  # one failed: nothing more to wait for
                    return
            if not waiting:
                joined.set_result(None)

        for connection in connections:
            connection.due_within(self._timeout_s, "upstream did not answer in time")
            connection.done.add_done_callback(on_answer)
        on_answer()
        try:
            await joined
        finally:
            for connection in connections:
                connection.deadline = NEVER

    async def stream(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> AsyncGenerator[tuple[int, list[bytes]]]:
        """Yields ``(status, [])`` once the head arrives, then ``(status, lines)`` for the body
        lines that arrived together (one batch per read, never empty).

        Batches, not single lines: a busy engine (or a gateway that was busy elsewhere) delivers
        several stream chunks at once, and the pipeline checks and sends them as one.
        A consumer may stop early (at SSE ``[DONE]``): the connection goes back to the pool
        if the response had fully arrived by then, and is closed otherwise.
        """
        connection = await self.send(url, body, headers)
        try:
            await self._wait(connection, connection.headers_done, "upstream did not answer in time")
            status = connection.status
            yield status, []
            pending = b""
            while True:
                if connection.chunks:
                    data = pending + b"".join(connection.chunks)
                    connection.chunks.clear()
                    *lines, pending = data.split(b"\n")
                    if lines:
                        yield status, [line.rstrip(b"\r") for line in lines]
                        continue  # more may have arrived while the consumer had the batch
                if connection.done.done():
                    connection.done.result()  # raises if it failed
                    if not connection.chunks:
                        break
                    continue
                readable = connection.readable = asyncio.get_running_loop().create_future()
                await self._wait(connection, readable, "upstream stream stalled")
            if pending:
                yield status, [pending]
        finally:
            self.finish(connection)

    async def _wait(
        self,
        connection: UpstreamConnection,
        future: asyncio.Future[None],
        message: str,
        timeout_s: float | None = None,
    ) -> None:
        # A deadline that fails the connection's futures, once per streamed chunk: a loop
        # timer each, or ``asyncio.timeout``, cost many times what the chunk's own work does.
        connection.due_within(self._timeout_s if timeout_s is None else timeout_s, message)
        try:
            await future
        finally:
            connection.deadline = NEVER

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
