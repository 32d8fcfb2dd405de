"""API key authentication: hashed lookup, the admin key, the cache and revocation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import delete

from gateway.common.errors import APIError
from gateway.config.settings import Settings
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.store import ADMIN_TENANT_ID, Store, api_keys, create_store

from .conftest import ADMIN_KEY

pytestmark = pytest.mark.anyio


async def refused(authenticator: Authenticator, header: str | None) -> APIError:
    with pytest.raises(APIError) as caught:
        await authenticator.authenticate(header)
    return caught.value


async def test_tenant_key_authenticates_as_its_tenant(store: Store, settings: Settings) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    principal = await Authenticator(store, settings).authenticate(f"Bearer {raw_key}")
    assert (principal.tenant_id, principal.key_id, principal.is_admin) == ("acme", record.id, False)


async def test_admin_key_authenticates_as_admin(store: Store, settings: Settings) -> None:
    principal = await Authenticator(store, settings).authenticate(f"Bearer {ADMIN_KEY}")
    assert principal.is_admin and principal.tenant_id == ADMIN_TENANT_ID


async def test_no_admin_key_configured_means_no_admin(store: Store, settings: Settings) -> None:
    authenticator = Authenticator(store, settings.model_copy(update={"admin_key": None}))
    assert (await refused(authenticator, f"Bearer {ADMIN_KEY}")).status == 401


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic abc",
        "sk-iso-abc",
        "Bearer sk-iso-a b",
        "Bearer sk-iso-unknown",
    ],
)
async def test_missing_malformed_and_unknown_keys_are_401(
    store: Store, settings: Settings, header: str | None
) -> None:
    error = await refused(Authenticator(store, settings), header)
    assert (error.status, error.type, error.code) == (
        401,
        "authentication_error",
        "invalid_api_key",
    )


async def test_revoking_through_this_process_takes_effect_at_once(
    store: Store, settings: Settings
) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    authenticator = Authenticator(store, settings)  # TTL 5 s
    await authenticator.authenticate(f"Bearer {raw_key}")  # now cached
    store.revoke_key(record.id)
    authenticator.forget_key(record.id)  # what the admin API does after revoking
    assert (await refused(authenticator, f"Bearer {raw_key}")).status == 401


async def test_revoking_elsewhere_takes_effect_within_the_cache_ttl(
    store: Store, settings: Settings
) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    replica = Authenticator(store, settings.model_copy(update={"auth_cache_ttl_s": 2.0}))
    await replica.authenticate(f"Bearer {raw_key}")
    store.revoke_key(record.id)  # by another replica or the CLI: this one is not told
    await replica.authenticate(f"Bearer {raw_key}")  # still cached: allowed within the TTL
    time.sleep(2.05)  # noqa: ASYNC251  # kept blocking (as written): no loop task runs meanwhile
    assert (await refused(replica, f"Bearer {raw_key}")).status == 401


async def test_disabled_tenant_keys_are_refused(store: Store, settings: Settings) -> None:
    store.create_tenant("acme")
    raw_key, _ = store.create_key("acme")
    authenticator = Authenticator(store, settings)
    await authenticator.authenticate(f"Bearer {raw_key}")
    store.set_tenant_disabled("acme", True)
    authenticator.forget_tenant("acme")
    error = await refused(authenticator, f"Bearer {raw_key}")
    assert (error.status, error.code) == (403, "forbidden")


async def test_cached_key_is_served_without_the_database(store: Store, settings: Settings) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    authenticator = Authenticator(store, settings)
    await authenticator.authenticate(f"Bearer {raw_key}")
    with store.engine.begin() as conn:  # the row is gone, the cache still knows the key
        conn.execute(delete(api_keys).where(api_keys.c.id == record.id))
    store.dispose()
    principal = await authenticator.authenticate(f"Bearer {raw_key}")
    assert principal.key_id == record.id


async def test_cached_authentication_is_fast(store: Store, settings: Settings) -> None:
    store.create_tenant("acme")
    raw_key, _ = store.create_key("acme")
    authenticator = Authenticator(store, settings)
    header = f"Bearer {raw_key}"
    await authenticator.authenticate(header)
    rounds = 20_000
    started = (
        time.thread_time()
    )  # CPU of this thread: what a request pays, however busy the machine
    for _ in range(rounds):
        await authenticator.authenticate(header)
    per_call_us = (time.thread_time() - started) / rounds * 1e6
    print(f"cached authenticate: {per_call_us:.1f} us/call")
    assert per_call_us < 50


class KeyStoreOutage:
    """The key store becomes unreadable: PostgreSQL's network path is cut; SQLite's file is
    moved away (a fresh connection then finds an empty database without tables)."""

    def __init__(self, database_url: str):
        from sqlalchemy.engine import make_url

        from .severable_proxy import SeverableProxy

        self.database_url = database_url
        self.proxy = None
        if database_url.startswith("postgresql"):
            url = make_url(database_url)
            self.proxy = SeverableProxy(url.host or "127.0.0.1", url.port or 5432)
            self.proxy.restore()
            self.store_url = url.set(port=self.proxy.port).render_as_string(hide_password=False)
        else:
            self.store_url = database_url
            self.path = Path(database_url.removeprefix("sqlite:///"))

    def begin(self, store: Store) -> None:
        if self.proxy is not None:
            self.proxy.sever()
        else:
            store.dispose()
            for suffix in ("", "-wal", "-shm"):
                source = Path(str(self.path) + suffix)
                if source.exists():
                    source.rename(str(source) + ".away")

    def end(self, store: Store) -> None:
        if self.proxy is not None:
            self.proxy.restore()
        else:
            store.dispose()
            for suffix in ("", "-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
                moved = Path(str(self.path) + suffix + ".away")
                if moved.exists():
                    moved.rename(str(self.path) + suffix)


async def test_recently_valid_key_keeps_working_while_the_key_store_is_down(
    store: Store, settings: Settings, database_url: str
) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    outage = KeyStoreOutage(database_url)
    gateway_store = create_store(outage.store_url, busy_timeout_s=1)
    authenticator = Authenticator(
        gateway_store, settings.model_copy(update={"auth_cache_ttl_s": 0.1})
    )
    await authenticator.authenticate(f"Bearer {raw_key}")
    try:
        outage.begin(gateway_store)
        time.sleep(0.15)  # noqa: ASYNC251  # kept blocking (as written); the cache entry expires
        for _ in range(3):
            assert (await authenticator.authenticate(f"Bearer {raw_key}")).key_id == record.id
        # A key never seen valid is not let in on stale data: the store's outage is reported.
        error = await refused(authenticator, "Bearer sk-iso-never-seen")
        assert (error.status, error.code) == (503, "auth_store_unavailable")
        # Revocation through this process still takes effect at once, store or no store.
        authenticator.forget_key(record.id)
        assert (await refused(authenticator, f"Bearer {raw_key}")).status == 503
    finally:
        outage.end(gateway_store)
        if outage.proxy is not None:
            outage.proxy.sever()
        gateway_store.dispose()


async def test_stale_keys_are_refused_when_stale_if_error_is_off(
    store: Store, settings: Settings, database_url: str
) -> None:
    store.create_tenant("acme")
    raw_key, _ = store.create_key("acme")
    outage = KeyStoreOutage(database_url)
    gateway_store = create_store(outage.store_url, busy_timeout_s=1)
    authenticator = Authenticator(
        gateway_store,
        settings.model_copy(update={"auth_cache_ttl_s": 0.1, "auth_stale_if_error_s": 0.0}),
    )
    await authenticator.authenticate(f"Bearer {raw_key}")
    try:
        outage.begin(gateway_store)
        time.sleep(0.15)  # noqa: ASYNC251  # kept blocking (as written): no loop task runs meanwhile
        assert (await refused(authenticator, f"Bearer {raw_key}")).status == 503
    finally:
        outage.end(gateway_store)
        if outage.proxy is not None:
            outage.proxy.sever()
        gateway_store.dispose()
