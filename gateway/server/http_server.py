"""The HTTP/1.1 server protocol: uvicorn's httptools protocol with the client bounds it lacks.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``), but nothing
bounds a client that never finishes its headers, sends headers without end, or opens more
connections than the process can serve. This protocol adds, each from ``ClientBounds``:

- an idle timeout before a connection's first byte (``first_byte_timeout_s``): a socket that
  sends nothing is closed, silently, long before the header timeout would close it;
- a header timeout, from the connection's first byte (or its opening, without an idle
  timeout) and from each later request's first byte, to the end of that request's headers;
- a body timeout, from the end of the headers to the end of the body, armed only when a read
  ends with the body incomplete (most bodies arrive with their headers and need none);
- a limit on the bytes of a request line and its headers (431);
- a limit on open connections (503 once the headers are in, as uvicorn's own limit does);
- a limit on the connections open from one client address at once (``PeerConnections``): one
  past it is answered 503 and closed as soon as it opens, so it never counts toward the global
  limit, and idle sockets from one address cannot crowd every other client out. A trusted
  proxy's connections (``trusted_proxies``, the peers whose ``X-Forwarded-For`` is read) carry
  many clients and are not capped (the proxy bounds its own clients);
- a ``DisconnectHook`` in each request's scope (``scope["extensions"][DISCONNECT_EXTENSION]
  ["hook"]``, an extension's value being a dict in ASGI):
  the request can have a callback run when the connection is lost, instead of a task of its
  own waiting on ``receive()`` for ``http.disconnect``; a request this protocol refused while
  it was being served (its body timed out) finds the refusal there.

These timeouts and uvicorn's keep-alive are one deadline per connection, checked by the
server's ``DeadlineSweep`` (``gateway.common.deadlines``), not a loop timer armed and cancelled for
each request.

Each refusal is an OpenAI error object with ``connection: close``, written before the
connection is closed, where the client can still read one. Under another server the body's
timeout is kept where the body is read (``gateway.api.pipeline.read_body``).

Each request's cycle is a ``GatewayCycle``: uvicorn's, except that a whole answer (a head that
declares its length, then the body in one message) is checked in one pass and written with
its body in one system call. uvicorn checks, lower-cases and compares each header in Python;
with OpenAI's six ``x-ratelimit-*`` headers on every answer, that cost a request 4.5 % of its
instructions (``bench/RESULTS.md``). Any other response is uvicorn's own.

Where this protocol serves a request, its scope offers ``HEADER_LINES_EXTENSION``: the app's
``http.response.start`` message may then carry, under that key, header lines it made itself
(``name: value\r\n`` each, lower-case token names, values without control characters),
written after the message's ``headers`` as they are, unchecked. The gateway's own answers
and streams (content type, length, generation ID, rate limits) are made that way, in one
format operation, instead of as pairs that are built, then checked and joined one by one; a
stream's head is then written here too, chunked as uvicorn chunks it (uvicorn's own checks
of nine headers, in Python, were a tenth of a stream's instructions).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import itertools
import operator
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import httptools
import orjson
from uvicorn._types import ASGISendEvent, HTTPResponseStartEvent
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.common.deadlines import DEFAULT_RESOLUTION_S, NEVER, DeadlineSweep
from gateway.common.errors import APIError

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class ClientBounds:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_connections: int
    deadline_resolution_s: float = DEFAULT_RESOLUTION_S
    # None: no cap per client address; no idle timeout (the header timeout runs from the open).
    max_connections_per_address: int | None = None
    first_byte_timeout_s: float | None = None
    # Peers not capped per address: uvicorn's ``forwarded_allow_ips`` form (IPs or networks,
    # comma-separated; "*" for any).
    trusted_proxies: str = ""


class PeerConnections:
    """How many connections each client address has open, for the cap per address; shared by
    every connection of one server process (each ``--workers`` process counts its own)."""

    def __init__(self, cap: int | None, trusted_proxies: str = "") -> None:
        self.cap = cap
        self._trusted_proxies = trusted_proxies
        items = [item.strip() for item in trusted_proxies.split(",") if item.strip()]
        self._trust_all = "*" in items
        self._trusted: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._literals: set[str] = set()  # not an address (as uvicorn: compared as written)
        for item in items:
            try:
                self._trusted.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self._literals.add(item)
        self._open: dict[str, int] = {}
        self._exempt: dict[str, bool] = {}  # address -> trusted, remembered per address seen

    def exempt(self, address: str) -> bool:
        """Whether connections from ``address`` are not counted: no cap, or a trusted proxy."""
        return self.cap is None or self._is_trusted(address)

    def open(self, address: str) -> bool:
        """Count a connection from ``address`` (not exempt); False, and not counted, if it is
        one too many."""
        count = self._open.get(address, 0)
        if self.cap is not None and count >= self.cap:
            return False
        self._open[address] = count + 1
        return True

    def close(self, address: str) -> None:
        """A connection that ``open`` counted has closed."""
        count = self._open.get(address, 0)
        if count <= 1:
            self._open.pop(address, None)
        else:
            self._open[address] = count - 1

    def counted(self, address: str) -> int:
        return self._open.get(address, 0)

    def _is_trusted(self, address: str) -> bool:
        trusted = self._exempt.get(address)
        if trusted is None:
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                trusted = self._trust_all or address in self._literals
            else:
                trusted = self._trust_all or any(ip in net for net in self._trusted)
            if len(self._exempt) >= _EXEMPT_REMEMBERED:
                self._exempt.clear()
            self._exempt[address] = trusted
        return trusted

    def __reduce__(self) -> tuple[type[PeerConnections], tuple[int | None, str]]:
        # What a ``--workers`` process gets: the same bounds, its own counts.
        return PeerConnections, (self.cap, self._trusted_proxies)


# Addresses whose trust is remembered (a cache, emptied when full: a flood of addresses costs
# one parse each, never unbounded memory).
_EXEMPT_REMEMBERED = 65_536


# What a connection waits for, and so which deadline holds (``nothing``: none, while a request
# is served).
_Phase = Literal["first byte", "headers", "body", "next request", "nothing"]

DISCONNECT_EXTENSION = "isogate.disconnect"
HEADER_LINES_EXTENSION = "isogate.header_lines"


class DisconnectHook:
    """One request's line to its connection: ``gone`` once the connection is lost before the
    response completed, and ``callback`` (set by the request, cleared when it no longer cares)
    run at that moment; ``refused``, what the client was answered if this protocol refused
    the request itself and closed the connection."""

    __slots__ = ("callback", "gone", "refused")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.gone = False
        self.refused: APIError | None = None


def header_lines_offered(scope: Mapping[str, Any]) -> bool:
    """Whether the server takes header lines in a start message (the module doc)."""
    return HEADER_LINES_EXTENSION in (scope.get("extensions") or ())


def response_start(
    status: int, headers: list[tuple[bytes, bytes]], lines: bytes, *, lines_taken: bool
) -> dict[str, Any]:
    """An ``http.response.start`` message: ``headers``, then ``lines`` as header lines where the
    server takes them (``header_lines_offered``), else as the pairs they stand for."""
    if lines_taken:
        return {
            "type": "http.response.start",
            "status": status,
            "headers": headers,
            HEADER_LINES_EXTENSION: lines,
        }
    pairs = [*headers, *header_pairs(lines)]
    return {"type": "http.response.start", "status": status, "headers": pairs}


def header_pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    """Header lines as ASGI's (name, value) pairs, for a server that takes only those."""
    return [
        (name, value)
        for name, _, value in (line.partition(b": ") for line in lines.split(b"\r\n") if line)
    ]


def disconnect_hook(scope: Mapping[str, Any]) -> DisconnectHook | None:
    """The request's hook, where this protocol serves it."""
    extension = (scope.get("extensions") or {}).get(DISCONNECT_EXTENSION)
    return extension["hook"] if extension else None


class _Refused(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


def bounded_protocol(bounds: ClientBounds) -> Any:
    """uvicorn's ``http=``: its httptools protocol, bounded by ``bounds``, every connection's
    deadlines on one sweep (a partial, not a class made here, so that it pickles for
    ``--workers`` > 1, each worker with a sweep of its own)."""
    return functools.partial(
        BoundedHttpToolsProtocol,
        bounds=bounds,
        sweep=DeadlineSweep(bounds.deadline_resolution_s),
        peers=PeerConnections(bounds.max_connections_per_address, bounds.trusted_proxies),
    )


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self,
        *args: Any,
        bounds: ClientBounds,
        sweep: DeadlineSweep,
        peers: PeerConnections | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._bounds = bounds
        self._peers = peers
        self._counted_as: str | None = None  # the address ``peers`` counted this connection as
        # Bytes received while a request's headers are not complete: a request line or headers
        # without end are refused from this count; complete ones are measured whole.
        self._awaiting_headers = True
        self._received_in_headers = 0
        self._in_body = False  # headers complete, body not yet
        # The one deadline that holds now (``_waiting_for`` says for what), on the loop's
        # clock, checked by the server's sweep; the phases never overlap.
        self._sweep = sweep
        self.deadline = NEVER
        self._waiting_for: _Phase = "nothing"
        # Hooks of the requests whose responses are not complete, oldest first (pipelined
        # requests complete in order).
        self._hooks: deque[DisconnectHook] = deque()
        # Header lines only where this protocol writes heads itself (not with an access log).
        self._offers: dict[str, dict[object, object]] = (
            {} if self.access_log else {HEADER_LINES_EXTENSION: {}}
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's is not an ``asyncio.Transport`` subclass).
        super().connection_made(cast(asyncio.Transport, transport))
        peers, client = self._peers, self.client
        if peers is not None and client is not None and not peers.exempt(client[0]):
            if not peers.open(client[0]):
                self._refuse(_too_many_connections("from your address"))
                return
            self._counted_as = client[0]
        self._sweep.watch(self, self.loop)
        first_byte_s = self._bounds.first_byte_timeout_s
        if first_byte_s is None:
            self._wait_for("headers", self._bounds.header_timeout_s)
        else:
            self._wait_for("first byte", first_byte_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._sweep.unwatch(self)
        self._wait_for("nothing")
        if self._counted_as is not None:
            assert self._peers is not None  # only counted where there is a count
            self._peers.close(self._counted_as)
            self._counted_as = None
        super().connection_lost(exc)
        hooks, self._hooks = self._hooks, deque()
        for hook in hooks:
            hook.gone = True
            if hook.callback is not None:
                hook.callback()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._waiting_for in ("next request", "first byte"):  # its first byte: its headers
            self._wait_for("headers", self._bounds.header_timeout_s)
        if self._awaiting_headers:
            self._received_in_headers += len(data)
        try:
            self.parser.feed_data(data)
            if self._awaiting_headers and self._received_in_headers > self._bounds.max_header_bytes:
                raise _Refused(_header_too_large(self._bounds))
        except _Refused as refused:
            self._refuse(refused.error)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._refuse(cause.error if isinstance(cause, _Refused) else _bad_request())
        except httptools.HttpParserError:
            self._refuse(_bad_request())
        else:
            if self._in_body and self._waiting_for == "nothing":
                self._wait_for("body", self._bounds.body_timeout_s)

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, but the Expect header is looked for once the headers are complete, not
        # compared on every header as it arrives.
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._wait_for("nothing")
        self._awaiting_headers, self._received_in_headers = False, 0
        # Measured once here, not per header as the parser hands them over: a callback of ours
        # on every header cost more than the rest of this protocol together (and in C: a
        # Python loop over the headers cost a call of len() for each name and value).
        headers = self.headers
        size = (
            len(self.url) + 4 * len(headers) + sum(map(len, itertools.chain.from_iterable(headers)))
        )
        if size > self._bounds.max_header_bytes:
            raise _Refused(_header_too_large(self._bounds))
        if len(self.connections) > self._bounds.max_connections:
            raise _Refused(_too_many_connections())
        if b"expect" in map(_NAME, headers):  # in C; the values looked at only if there is one
            self.expect_100_continue = any(
                n == b"expect" and v.lower() == b"100-continue" for n, v in headers
            )
        hook = DisconnectHook()
        self.scope["extensions"] = {DISCONNECT_EXTENSION: {"hook": hook}, **self._offers}
        self._hooks.append(hook)
        self._in_body = True
        self._start_cycle()

    def _start_cycle(self) -> None:
        """uvicorn's ``on_headers_complete``, step for step, but the cycle is a
        ``GatewayCycle`` (made here: an instance whose class changed after it was made would
        miss the interpreter's attribute caches on every access)."""
        parser = self.parser
        http_version = parser.get_http_version()
        self.scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            self.scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            return
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        self.scope["path"] = self.root_path + path
        self.scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        self.scope["query_string"] = url.query or b""
        app = self.app
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency
            or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        existing = self.cycle
        self.cycle = GatewayCycle(
            scope=self.scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:  # pipelined: served once the one before has been answered
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def on_response_complete(self) -> None:
        """uvicorn's, but keep-alive is a deadline of the sweep's, not a timer of its own."""
        if self._hooks:
            self._hooks.popleft()
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request, held back until this one's answer
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._waiting_for == "nothing":  # (its first byte may be in already)
            self._wait_for("next request", self.timeout_keep_alive)

    def on_message_complete(self) -> None:
        if self._in_body:
            self._in_body = False
            if self._waiting_for == "body":
                self._wait_for("nothing")
        super().on_message_complete()
        self._awaiting_headers = True  # the next request's

    def _wait_for(self, what: _Phase, within_s: float = NEVER) -> None:
        self._waiting_for = what
        self.deadline = NEVER if what == "nothing" else self.loop.time() + within_s

    def deadline_passed(self) -> None:
        """The sweep's call: what this connection waited for did not come in time."""
        waited_for, self._waiting_for = self._waiting_for, "nothing"
        if waited_for == "headers":
            self._headers_timed_out()
        elif waited_for == "body":
            self._body_timed_out()
        elif waited_for in ("next request", "first byte") and not self.transport.is_closing():
            # Keep-alive ran out, as uvicorn closes it; or the socket never sent a byte (a
            # client that sends nothing reads no answer either).
            self.transport.close()

    def _body_timed_out(self) -> None:
        if not self._in_body or self.transport.is_closing():
            return
        error = body_timeout_error(self._bounds.body_timeout_s)
        if self._hooks:
            self._hooks[-1].refused = error  # the request being read: the last one begun
        self._refuse(error)

    def _headers_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its body has its own timeout
        self._refuse(
            APIError(
                408,
                f"The request's headers did not arrive within {self._bounds.header_timeout_s} s.",
                "invalid_request_error",
                "request_timeout",
            )
        )

    def _refuse(self, error: APIError) -> None:
        self._wait_for("nothing")
        if not self.transport.is_closing():
            self.transport.write(_error_response(error))
            self.transport.close()


_NAME_CHARS = b"abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~"
_VALUE_CHARS = bytes([0x09, *range(0x20, 0x7F), *range(0x80, 0x100)])
# Translation tables that map every allowed byte to 1 and every other byte to 0: a translated
# text holds a 0 exactly where the original holds a byte not allowed. (``translate`` with
# characters to delete builds its table anew on every call, from every allowed character.)
_NAME_TABLE = bytes(int(byte in _NAME_CHARS) for byte in range(256))
_VALUE_TABLE = bytes(int(byte in _VALUE_CHARS) for byte in range(256))
_LENGTH_FIELD = b"\r\ncontent-length: "
_NAME, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def _checked_lines(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """``headers`` as header lines (``name: value\\r\\n`` each), or None if one breaks the rules:
    every name in lower-case token characters, every value without a control character but
    tab (narrower than uvicorn's patterns, which judge whatever falls outside). Each check is
    per character, so all names (or values) joined pass exactly when each does; by C calls
    (map over C callables, translate), not a loop of the interpreter per header."""
    pairs = list(headers)  # ASGI's headers are any iterable: read once
    names = b"".join(map(_NAME, pairs))
    values = b"".join(map(_VALUE, pairs))
    if 0 in names.translate(_NAME_TABLE) or 0 in values.translate(_VALUE_TABLE):
        return None
    return b"\r\n".join(map(b": ".join, pairs)) + b"\r\n" if pairs else b""


# The server's own headers (its date, its configured ones) change once a second: checked and
# joined then, not for every answer.
_server_lines = functools.lru_cache(maxsize=8)(_checked_lines)


class GatewayCycle(RequestResponseCycle):
    """uvicorn's request-response cycle with a fast path for a whole answer (the module doc).

    The fast path takes a head with exactly one ``content-length``, no ``transfer-encoding``
    or ``connection`` header, to a request other than HEAD, while writing is not paused. The
    head is held until the body's one message comes, and both are written together; a body
    that comes in parts, or of another length, is written by uvicorn after the head.
    """

    _head: bytes | None = None

    async def send(self, message: ASGISendEvent) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if (
                message["type"] == "http.response.body"
                and not self.chunked_encoding
                and not message.get("more_body", False)
                and len(body := message.get("body", b"")) == self.expected_content_length
                and not self.flow.write_paused
                and not self.disconnected
            ):
                self.transport.writelines((head, body))
                self.expected_content_length = 0
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()
                return
            if not self.disconnected:
                self.transport.write(head)
        elif not self.response_started and message["type"] == "http.response.start":
            head = self._whole_answer_head(message)
            if head is not None:
                self._head = head
                return
            lines = message.get(HEADER_LINES_EXTENSION)
            if lines:  # uvicorn's path takes pairs only
                headers = [*message.get("headers", ()), *header_pairs(cast(bytes, lines))]
                message = cast(HTTPResponseStartEvent, {**message, "headers": headers})
        await super().send(message)

    def _whole_answer_head(self, message: HTTPResponseStartEvent) -> bytes | None:
        """The head, with the response started as uvicorn would start it (a whole answer's, or
        a stream's that the app made header lines for); None (nothing changed) where the fast
        path does not apply."""
        if self.flow.write_paused or self.disconnected or self.access_log:
            return None
        if self.scope["method"] == "HEAD":
            return None
        # The app's pairs checked here, its lines not at all (the module doc).
        server = _server_lines(tuple(self.default_headers))
        own = message.get("headers")
        app = _checked_lines(own) if own else b""
        if server is None or app is None:
            return None
        vouched = message.get(HEADER_LINES_EXTENSION, b"")
        assert isinstance(vouched, bytes)  # the gateway's own lines (``response_start``)
        head = STATUS_LINE[message["status"]] + server + app + vouched
        # find, not ``in``: ``bytes in bytes`` first tries the operand as an integer and
        # raises and clears a TypeError inside on every call.
        if head.find(b"\r\ntransfer-encoding:") >= 0 or head.find(b"\r\nconnection:") >= 0:
            return None
        at = head.find(_LENGTH_FIELD)
        if at < 0:
            # No length: a stream, chunked as uvicorn chunks it; only a head the app made
            # lines for (the gateway's own), and only where uvicorn would chunk it.
            if not vouched or message["status"] in (204, 304):
                return None
            head += b"transfer-encoding: chunked\r\n"
            self.expected_content_length = 0
            self.chunked_encoding = True
        else:
            start = at + len(_LENGTH_FIELD)
            length = head[start : head.index(b"\r\n", start)]
            if not length.isdigit() or head.find(_LENGTH_FIELD, at + 1) >= 0:
                return None
            self.expected_content_length = int(length)
            self.chunked_encoding = False
        self.response_started = True
        self.waiting_for_100_continue = False
        if not self.keep_alive:
            head += b"connection: close\r\n"
        return head + b"\r\n"


def body_timeout_error(timeout_s: float) -> APIError:
    """The 408 for a body not all in within ``timeout_s``, whichever side timed it."""
    return APIError(
        408,
        f"The request body did not arrive within {timeout_s} s.",
        "invalid_request_error",
        "request_timeout",
    )


def _header_too_large(bounds: ClientBounds) -> APIError:
    return APIError(
        431,
        f"The request line and headers exceed {bounds.max_header_bytes} bytes.",
        "invalid_request_error",
        "request_header_too_large",
    )


def _too_many_connections(whose: str = "") -> APIError:
    return APIError(
        503,
        " ".join(filter(None, ["The gateway has too many open connections", whose]))
        + "; try again shortly.",
        "service_unavailable_error",
        "too_many_connections",
        headers={"Retry-After": "1"},
    )


def _bad_request() -> APIError:
    return APIError(400, "Invalid HTTP request received.", "invalid_request_error", "invalid_http")


def _error_response(error: APIError) -> bytes:
    body = orjson.dumps(error.body())
    head = [b"HTTP/1.1 %d %s\r\n" % (error.status, _REASONS.get(error.status, b"Error"))]
    head += [b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in error.headers.items()]
    head += [
        b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body
