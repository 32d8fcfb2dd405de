"""One client address cannot fill the gateway's connections: each address may hold only so many
open at once (past that, a new one is answered 503 and closed at once), and a connection that
sends nothing is closed after a short idle timeout, well before the header timeout. Other
addresses, and ``/healthz``, are served meanwhile. A trusted proxy's connections carry many
clients, so they are not capped per address.

Real sockets on loopback against a gateway process: the crowding client is 127.0.0.1, the other
client binds its socket to 127.0.0.2 and the trusted proxy to 127.0.0.3 (the whole of 127/8 is
loopback). The header timeout is far above the idle timeout, and each close is awaited with a
deadline between the two, so a gateway that let the header timeout close idle sockets fails.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import orjson
import pytest

from tests.reliability.stack import StandInStack, standin_stack

MAX_CONNECTIONS = 8
PER_ADDRESS = 4
IDLE_TIMEOUT_S = 2
HEADER_TIMEOUT_S = 60
# The deadline for what the idle timeout should close: far before the header timeout.
PATIENCE_S = 30
CROWD = "127.0.0.1"
OTHER = "127.0.0.2"
PROXY = "127.0.0.3"


@pytest.fixture(scope="module")
def bounded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    with standin_stack(
        tmp_path_factory.mktemp("connection-bounds"),
        env={
            "ISOGATE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "ISOGATE_MAX_CONNECTIONS_PER_ADDRESS": str(PER_ADDRESS),
            "ISOGATE_FIRST_BYTE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
            "ISOGATE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "ISOGATE_FORWARDED_ALLOW_IPS": PROXY,
        },
    ) as running:
        yield running


def _connect(stack: StandInStack, source: str) -> socket.socket:
    address = urlsplit(stack.gateway.url)
    return socket.create_connection(
        (address.hostname, address.port), timeout=PATIENCE_S, source_address=(source, 0)
    )


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway writes until it closes the connection (the deadline: PATIENCE_S
    without a byte or the close fails the test)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            raise AssertionError(f"still open after {PATIENCE_S} s: {received[:200]!r}") from None
        if not chunk:
            return received
        received += chunk


def _healthz(stack: StandInStack, source: str) -> bytes:
    with contextlib.closing(_connect(stack, source)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        return _until_closed(sock)


def _status_and_code(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)["error"]["code"] if status != 200 else None


def test_one_address_cannot_fill_the_connections_and_its_idle_ones_are_closed(
    bounded_stack: StandInStack,
) -> None:
    # More idle sockets from one address than the whole gateway may hold.
    crowd = [_connect(bounded_stack, CROWD) for _ in range(MAX_CONNECTIONS + 2)]
    try:
        # Another address is served while they are open, and so is its /healthz.
        answer = _healthz(bounded_stack, OTHER)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        # The crowd's own extra connections were refused at once, the rest closed idle.
        closes = [_until_closed(sock) for sock in crowd]
    finally:
        for sock in crowd:
            sock.close()
    refused = [answer for answer in closes if answer]
    assert [_status_and_code(answer) for answer in refused] == [(503, "too_many_connections")] * (
        len(crowd) - PER_ADDRESS
    )
    assert all(b"connection: close" in answer.lower() for answer in refused)
    assert closes.count(b"") == PER_ADDRESS  # idle past the idle timeout: closed, nothing said
    # Once they are gone the address is served again.
    assert _healthz(bounded_stack, CROWD).startswith(b"HTTP/1.1 200 ")


def test_a_connection_that_sends_its_request_is_not_closed_as_idle(
    bounded_stack: StandInStack,
) -> None:
    with contextlib.closing(_connect(bounded_stack, OTHER)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first[:300]


def test_a_trusted_proxys_connections_are_not_capped_per_address(
    bounded_stack: StandInStack,
) -> None:
    proxy = [_connect(bounded_stack, PROXY) for _ in range(PER_ADDRESS + 2)]
    try:
        # All of them open, none refused: each still serves a request.
        for sock in proxy:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        answers = [_until_closed(sock) for sock in proxy]
    finally:
        for sock in proxy:
            sock.close()
    assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers), answers
