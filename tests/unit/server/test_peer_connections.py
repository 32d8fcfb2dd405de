"""``PeerConnections``: the count of open connections per client address behind the cap per
address, and which peers (the trusted proxies) it does not count."""

from __future__ import annotations

import pickle

import pytest

from gateway.server.http_server import PeerConnections


def test_an_address_gets_its_cap_and_its_room_back_as_connections_close() -> None:
    peers = PeerConnections(2)
    assert [peers.open("192.0.2.1") for _ in range(3)] == [True, True, False]
    assert peers.open("192.0.2.2")  # another address has a cap of its own
    peers.close("192.0.2.1")
    assert peers.open("192.0.2.1")
    assert peers.counted("192.0.2.1") == 2
    peers.close("192.0.2.1")
    peers.close("192.0.2.1")
    assert peers.counted("192.0.2.1") == 0


@pytest.mark.parametrize(
    ("trusted", "address", "exempt"),
    [
        ("", "10.0.0.1", False),
        ("10.0.0.1", "10.0.0.1", True),
        ("10.0.0.1", "10.0.0.2", False),
        ("10.0.0.0/24, 172.31.240.10", "10.0.0.200", True),
        ("10.0.0.0/24, 172.31.240.10", "172.31.240.10", True),
        ("10.0.0.0/24, 172.31.240.10", "172.31.240.11", False),
        ("*", "198.51.100.9", True),
        ("::1", "::1", True),
        ("10.0.0.1", "not-an-address", False),
        ("10.0.0.1, unix:/run/lb.sock", "unix:/run/lb.sock", True),  # as uvicorn: literally
    ],
)
def test_the_trusted_proxies_are_exempt(trusted: str, address: str, exempt: bool) -> None:
    assert PeerConnections(4, trusted).exempt(address) is exempt


def test_without_a_cap_no_address_is_counted() -> None:
    assert PeerConnections(None).exempt("192.0.2.1")


def test_each_worker_process_starts_with_its_own_counts() -> None:
    peers = PeerConnections(1, "10.0.0.1")
    assert peers.open("192.0.2.1")
    copy = pickle.loads(pickle.dumps(peers))
    assert copy.counted("192.0.2.1") == 0 and copy.open("192.0.2.1")
    assert copy.exempt("10.0.0.1") and not copy.open("192.0.2.1")
