"""Slow and oversized clients cannot hold connections: half a body, a half-sent chunked body,
half-sent headers and an idle socket are answered 408 (OpenAI format) and closed once their
timeout passes; oversized headers get 431; connections past the limit get 503.

Raw sockets against a gateway process whose timeouts are configured far below their defaults.
Each test awaits the gateway's answer or its close with the socket's own read timeout as the
deadline: a second less than the default of the timeout at stake, so a gateway that ignored
the configured timeout and kept its default fails, and one that keeps it has seconds to spare.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import orjson
import pytest

from gateway.config.settings import Settings
from tests.reliability.stack import MODEL, StandInStack, standin_stack

TIMEOUT_S = 1
MAX_CONNECTIONS = 4
DEFAULTS = Settings()


def _patience(default_s: float) -> float:
    """How long a test waits for what should come TIMEOUT_S after its start: less than the
    default, so that the default firing instead of the configured timeout fails the test."""
    patience_s = default_s - 1
    assert patience_s >= TIMEOUT_S + 2, f"the default {default_s} s is too close to {TIMEOUT_S} s"
    return patience_s


HEADER_PATIENCE_S = _patience(DEFAULTS.header_timeout_s)
BODY_PATIENCE_S = _patience(DEFAULTS.body_timeout_s)
KEEP_ALIVE_PATIENCE_S = _patience(DEFAULTS.keep_alive_timeout_s)
# For answers that need no timeout at all (a refusal of oversized headers, a 503).
ANSWER_PATIENCE_S = 30


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    with standin_stack(
        tmp_path_factory.mktemp("slow-clients"),
        env={
            "ISOGATE_HEADER_TIMEOUT_S": str(TIMEOUT_S),
            "ISOGATE_BODY_TIMEOUT_S": str(TIMEOUT_S),
            "ISOGATE_KEEP_ALIVE_TIMEOUT_S": str(TIMEOUT_S),
        },
    ) as running:
        yield running


@contextlib.contextmanager
def connection(
    stack: StandInStack, patience_s: float = ANSWER_PATIENCE_S
) -> Iterator[socket.socket]:
    """A raw connection whose reads fail after ``patience_s`` without a byte or a close."""
    address = urlsplit(stack.gateway.url)
    sock = socket.create_connection((address.hostname, address.port), timeout=patience_s)
    try:
        yield sock
    finally:
        sock.close()


def until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway writes until it closes the connection."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            raise AssertionError(
                f"still open {sock.gettimeout()} s after the last byte: {received[:200]!r}"
            ) from None
        if not chunk:
            return received
        received += chunk


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length, read without waiting for the close."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the answer's head: {received[:300]!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lengths = [
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    assert lengths, head
    while len(body) < lengths[0]:
        chunk = sock.recv(65536)
        assert chunk, f"closed inside the answer's body: {received[:300]!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def send_until_answered(sock: socket.socket, data: bytes, chunk_bytes: int = 64 * 1024) -> None:
    """Send ``data`` a chunk at a time, stopping as soon as the gateway has answered or closed:
    a refusal written while the rest is still on its way is then read, not lost to the reset
    that the rest would cause."""
    for start in range(0, len(data), chunk_bytes):
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            return
        try:
            sock.sendall(data[start : start + chunk_bytes])
        except (BrokenPipeError, ConnectionResetError):
            return


def assert_openai_error(response: bytes, status: int, code: str) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), response[:300]
    assert b"connection: close" in head.lower(), head
    error = orjson.loads(body)["error"]
    assert error["code"] == code and error["message"], error


def _request_head(stack: StandInStack, **headers: str) -> bytes:
    key = stack.key("slow-client")
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: gateway",
        f"Authorization: Bearer {key}",
        "Content-Type: application/json",
        *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chat() -> bytes:
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )


def _timed_out_events(stack: StandInStack) -> int:
    with stack.gateway.admin() as admin:
        events = admin.get(
            "/v1/audit/events", params={"tenant": "slow-client", "limit": "1000"}
        ).json()["data"]
    return sum(1 for e in events if (e["status"], e["code"]) == (408, "request_timeout"))


def test_half_a_body_is_answered_408_and_closed(slow_stack: StandInStack) -> None:
    body = _chat()
    head = _request_head(slow_stack, Content_Length=str(len(body)))
    recorded_before = _timed_out_events(slow_stack)
    with connection(slow_stack, BODY_PATIENCE_S) as sock:
        sock.sendall(head + body[:10])
        assert_openai_error(until_closed(sock), 408, "request_timeout")
    # The audit says what the client was told, not that it went away.
    deadline = time.monotonic() + ANSWER_PATIENCE_S
    while _timed_out_events(slow_stack) == recorded_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _timed_out_events(slow_stack) == recorded_before + 1


def test_a_half_sent_chunked_body_is_answered_408_and_closed(slow_stack: StandInStack) -> None:
    body = _chat()
    with connection(slow_stack, BODY_PATIENCE_S) as sock:
        first = b"%x\r\n%s\r\n" % (10, body[:10])
        sock.sendall(_request_head(slow_stack, Transfer_Encoding="chunked") + first)
        assert_openai_error(until_closed(sock), 408, "request_timeout")


def test_half_sent_headers_are_answered_408_and_closed(slow_stack: StandInStack) -> None:
    with connection(slow_stack, HEADER_PATIENCE_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthoriz")
        assert_openai_error(until_closed(sock), 408, "request_timeout")


def test_an_idle_socket_is_closed(slow_stack: StandInStack) -> None:
    with connection(slow_stack, HEADER_PATIENCE_S) as sock:
        until_closed(sock)


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(
    slow_stack: StandInStack,
) -> None:
    body = _chat()
    with connection(slow_stack) as sock:
        sock.sendall(_request_head(slow_stack, Content_Length=str(len(body))) + body)
        answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        # From the answer on, the connection idles: only the keep-alive timeout closes it.
        sock.settimeout(KEEP_ALIVE_PATIENCE_S)
        assert until_closed(sock) == b""


def test_a_16_mb_header_is_refused(slow_stack: StandInStack) -> None:
    header = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Padding: " + b"a" * (16 << 20)
    with connection(slow_stack) as sock:
        send_until_answered(sock, header + b"\r\n\r\n")
        response = until_closed(sock)
    # A gateway that crashed or dropped the connection sends nothing: that fails here too.
    assert_openai_error(response, 431, "request_header_too_large")
    with slow_stack.client(None) as client:
        assert client.get("/healthz").status_code == 200


def test_headers_over_the_limit_that_arrive_whole_in_one_read_are_refused(
    slow_stack: StandInStack,
) -> None:
    # Just past the default limit and sent in one write, so the parser can see the end of the
    # headers in the same read: measured whole at their end, not from the bytes still awaited.
    limit = Settings().max_header_bytes
    padding = b"a" * (limit + 1)
    head = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Padding: " + padding + b"\r\n\r\n"
    with connection(slow_stack) as sock:
        sock.sendall(head)
        response = until_closed(sock)
    assert_openai_error(response, 431, "request_header_too_large")


def test_connections_past_the_limit_get_503(tmp_path_factory: pytest.TempPathFactory) -> None:
    with (
        standin_stack(
            tmp_path_factory.mktemp("connection-limit"),
            env={"ISOGATE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)},
        ) as stack,
        contextlib.ExitStack() as held,
    ):
        for _ in range(MAX_CONNECTIONS):
            held.enter_context(connection(stack))  # open, idle
        with connection(stack) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            assert_openai_error(until_closed(sock), 503, "too_many_connections")
        held.close()
        with connection(stack) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
            assert until_closed(sock).startswith(b"HTTP/1.1 200 ")
