"""Failed authentications limited per client address, without ever refusing a valid key.

``UnauthenticatedClients`` counts failures per address and answers 429 once an address has
spent its allowance, but only for failures: every key is looked up first. What protects the
store from a flood of made-up keys is that an address past its allowance has its unknown keys
looked up one at a time (keys known valid skip that line).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading

import pytest

from gateway.common.errors import APIError
from gateway.config.settings import Settings
from gateway.observability.metrics import Metrics
from gateway.tenancy.auth import Authenticator, UnauthenticatedClients
from gateway.tenancy.store import KeyLookup, Store

pytestmark = pytest.mark.anyio

ALLOWANCE = 5
ADDRESS = "203.0.113.9"
# How long a test waits for something that must happen (a deadline, not a pause).
PATIENCE_S = 30


async def _fails(clients: UnauthenticatedClients, authenticator: Authenticator, key: str) -> int:
    with pytest.raises(APIError) as caught:
        await clients.authenticate(authenticator, f"Bearer {key}", ADDRESS)
    return caught.value.status


async def test_a_new_valid_key_is_served_from_an_address_that_spent_its_allowance(
    store: Store, settings: Settings
) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")  # never presented: in no cache
    clients = UnauthenticatedClients(Metrics(), per_minute=ALLOWANCE)
    authenticator = Authenticator(store, settings)
    statuses = [await _fails(clients, authenticator, f"sk-iso-bad-{n}") for n in range(605)]
    assert statuses[:ALLOWANCE] == [401] * ALLOWANCE
    assert set(statuses[ALLOWANCE:]) == {429}
    principal = await clients.authenticate(authenticator, f"Bearer {raw_key}", ADDRESS)
    assert principal.key_id == record.id
    # The address is still throttled for what it gets wrong.
    assert await _fails(clients, authenticator, "sk-iso-bad-again") == 429
    # A request without any key is a failure too.
    with pytest.raises(APIError) as caught:
        await clients.authenticate(authenticator, None, ADDRESS)
    assert caught.value.status == 429


async def test_failures_of_one_address_leave_another_its_allowance(
    store: Store, settings: Settings
) -> None:
    clients = UnauthenticatedClients(Metrics(), per_minute=ALLOWANCE)
    authenticator = Authenticator(store, settings)
    for n in range(ALLOWANCE + 1):
        await _fails(clients, authenticator, f"sk-iso-bad-{n}")
    with pytest.raises(APIError) as caught:
        await clients.authenticate(authenticator, "Bearer sk-iso-bad-0", "198.51.100.1")
    assert caught.value.status == 401


class GatedStore:
    """A key store whose lookups wait until the test lets each one through, and which records
    how many were in flight at once. Unknown keys only, but for ``valid``."""

    def __init__(self, valid: dict[str, KeyLookup] | None = None) -> None:
        self.valid = valid or {}
        self.entered = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self._changed = threading.Condition()
        self._passes = threading.Semaphore(0)

    def lookup_key(self, key_hash: str) -> KeyLookup | None:
        with self._changed:
            self.entered += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self._changed.notify_all()
        assert self._passes.acquire(timeout=PATIENCE_S), "never let through"
        with self._changed:
            self.in_flight -= 1
        return self.valid.get(key_hash)

    def let_one_through(self) -> None:
        self._passes.release()

    async def until_entered(self, count: int) -> None:
        def wait() -> None:
            with self._changed:
                assert self._changed.wait_for(lambda: self.entered >= count, PATIENCE_S)

        await asyncio.to_thread(wait)


async def test_an_address_past_its_allowance_costs_the_store_one_lookup_at_a_time() -> None:
    gated = GatedStore()
    authenticator = Authenticator(gated, Settings(_env_file=None))  # type: ignore[arg-type]
    clients = UnauthenticatedClients(Metrics(), per_minute=1)
    clients.refused(ADDRESS, APIError(401, "", "authentication_error", "invalid_api_key"))
    assert clients.spent(ADDRESS)
    flood = [
        asyncio.ensure_future(_fails(clients, authenticator, f"sk-iso-made-up-{n}"))
        for n in range(5)
    ]
    for number in range(1, len(flood) + 1):
        await gated.until_entered(number)
        gated.let_one_through()
    assert await asyncio.gather(*flood) == [429] * len(flood)
    assert gated.most_in_flight == 1


async def test_a_key_known_valid_skips_its_addresss_line() -> None:
    valid = KeyLookup(key_id="key_1", tenant_id="acme", revoked=False, tenant_disabled=False)
    key = "sk-iso-valid"
    gated = GatedStore({hashlib.sha256(key.encode()).hexdigest(): valid})
    settings = Settings(_env_file=None, auth_cache_ttl_s=0.0)  # every use asks the store again
    authenticator = Authenticator(gated, settings)  # type: ignore[arg-type]
    clients = UnauthenticatedClients(Metrics(), per_minute=1)
    first = asyncio.ensure_future(clients.authenticate(authenticator, f"Bearer {key}", ADDRESS))
    await gated.until_entered(1)
    gated.let_one_through()
    assert (await first).key_id == "key_1"
    clients.refused(ADDRESS, APIError(401, "", "authentication_error", "invalid_api_key"))
    # A made-up key of the same address holds the line, its lookup not let through...
    stuck = asyncio.ensure_future(_fails(clients, authenticator, "sk-iso-made-up"))
    await gated.until_entered(2)
    # ...and the key seen valid is looked up again beside it, not after it.
    again = asyncio.ensure_future(clients.authenticate(authenticator, f"Bearer {key}", ADDRESS))
    await gated.until_entered(3)
    gated.let_one_through()
    gated.let_one_through()
    assert (await again).key_id == "key_1"
    assert await stuck == 429
