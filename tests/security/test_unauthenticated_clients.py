"""Anonymous clients cannot lock a valid key out, and each client behind a trusted proxy is
limited on its own.

A client address that keeps failing authentication is throttled (429) for its failures only: a
valid key from the same address is still served. Behind a trusted proxy (``FORWARDED_ALLOW_IPS``)
the address is the one the proxy forwards (``X-Forwarded-For``); from any other peer that header
is ignored, so a client cannot pick its own address.

One gateway process, listening on 127.0.0.1 and trusting 127.0.0.1 as its proxy; an untrusted
peer is a client bound to 127.0.0.2 (another loopback address). The allowance of failures is
small, so a few requests spend it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.stack import StandInStack, chat_body, standin_stack
from tests.security.checks import assert_clean_error

FAILURES_PER_MINUTE = 5
# The flood: 605 made-up keys from one address before the valid key.
FLOOD = 605
TRUSTED_PROXY = "127.0.0.1"
UNTRUSTED_PEER = "127.0.0.2"


@pytest.fixture(scope="module")
def proxied_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    with standin_stack(
        tmp_path_factory.mktemp("unauthenticated"),
        env={
            "ISOGATE_UNAUTHENTICATED_PER_ADDRESS_PER_MINUTE": str(FAILURES_PER_MINUTE),
            "ISOGATE_FORWARDED_ALLOW_IPS": TRUSTED_PROXY,
        },
    ) as running:
        yield running


def _client(
    stack: StandInStack, *, key: str | None = None, peer: str = TRUSTED_PROXY
) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(
        base_url=stack.gateway.url,
        headers=headers,
        timeout=30,
        transport=httpx.HTTPTransport(local_address=peer),
    )


def _bad_key(client: httpx.Client, attempt: int, forwarded_for: str | None = None) -> int:
    headers = {"Authorization": f"Bearer sk-iso-made-up-{attempt}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    answer = client.post("/v1/chat/completions", json=chat_body(), headers=headers)
    assert_clean_error(answer.status_code, answer.content, statuses=(401, 429))
    return answer.status_code


def test_a_valid_key_is_served_from_an_address_flooding_bad_keys(
    proxied_stack: StandInStack,
) -> None:
    valid = proxied_stack.key("flooded-address")  # never used before: not in any cache
    address = "198.51.100.7"
    with _client(proxied_stack) as client:
        statuses = [_bad_key(client, attempt, address) for attempt in range(FLOOD)]
        assert statuses[-1] == 429  # the address is throttled for its failures
        served = client.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"Authorization": f"Bearer {valid}", "X-Forwarded-For": address},
        )
        assert served.status_code == 200, served.text
        # Bad keys keep coming from that address, and the valid key keeps being served.
        for attempt in range(10):
            assert _bad_key(client, FLOOD + attempt, address) == 429
            again = client.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={"Authorization": f"Bearer {valid}", "X-Forwarded-For": address},
            )
            assert again.status_code == 200, again.text


def test_clients_behind_a_trusted_proxy_are_limited_separately(
    proxied_stack: StandInStack,
) -> None:
    with _client(proxied_stack, peer=TRUSTED_PROXY) as proxy:
        first = [_bad_key(proxy, attempt, "203.0.113.1") for attempt in range(FAILURES_PER_MINUTE)]
        assert first == [401] * FAILURES_PER_MINUTE
        assert _bad_key(proxy, FAILURES_PER_MINUTE, "203.0.113.1") == 429
        # Another client of the same proxy still has its own allowance.
        assert _bad_key(proxy, 0, "203.0.113.2") == 401
        # The proxy appends its peer: the address is the last one it did not add itself.
        assert _bad_key(proxy, 1, "10.9.9.9, 203.0.113.3") == 401


def test_forwarded_headers_from_an_untrusted_peer_are_ignored(
    proxied_stack: StandInStack,
) -> None:
    with _client(proxied_stack, peer=UNTRUSTED_PEER) as client:
        # A new made-up forwarded address on every request: all count against the peer.
        statuses = [
            _bad_key(client, attempt, f"192.0.2.{attempt}")
            for attempt in range(FAILURES_PER_MINUTE + 2)
        ]
    assert statuses[:FAILURES_PER_MINUTE] == [401] * FAILURES_PER_MINUTE
    assert set(statuses[FAILURES_PER_MINUTE:]) == {429}
