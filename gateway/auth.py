"""API key → tenant.

Keys are 256-bit random tokens (``sk-iso-...``) stored only as their SHA-256. A presented
key is hashed and looked up in a small in-memory cache first; the database is asked only on
a miss, from a thread. Cache entries live ``settings.auth_cache_ttl_s``: a key revoked (or a
tenant disabled) through this process is forgotten at once (``forget_key``,
``forget_tenant``), through another replica within the TTL. Unknown keys are cached too
(negatively), so a client retrying a bad key does not reach the database on every request;
a new key is a fresh random token, so no negative entry can stand in its way.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import APIError, forbidden, unauthorized
from gateway.settings import Settings
from gateway.store import ADMIN_TENANT_ID, KeyLookup, hash_key

if TYPE_CHECKING:
    from gateway.store import Store

ADMIN_KEY_ID = "admin"
# Bounds memory under a flood of random keys; least recently used entries go first.
_CACHE_MAX_ENTRIES = 100_000


@dataclass(frozen=True, slots=True)
class Principal:
    tenant_id: str  # ADMIN_TENANT_ID ("__admin__") for the admin key
    key_id: str  # public id of the key, e.g. "key_..."; "admin" for the admin key
    is_admin: bool


ADMIN_PRINCIPAL = Principal(ADMIN_TENANT_ID, ADMIN_KEY_ID, True)


class Authenticator:
    def __init__(self, store: Store, settings: Settings):
        self._store = store
        self._ttl_s = settings.auth_cache_ttl_s
        # Compared as digests so the comparison's time does not depend on the key's length.
        self._admin_digest = (
            hashlib.sha256(settings.admin_key.encode()).digest() if settings.admin_key else None
        )
        # key hash → (lookup result or None for unknown, expiry on the monotonic clock)
        self._cache: OrderedDict[str, tuple[KeyLookup | None, float]] = OrderedDict()
        # Concurrent misses on one key share one database lookup.
        self._pending: dict[str, asyncio.Future[KeyLookup | None]] = {}

    async def authenticate(self, authorization: str | None) -> Principal:
        token = _bearer_token(authorization)
        if self._admin_digest is not None and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self._admin_digest
        ):
            return ADMIN_PRINCIPAL
        if not token.startswith("sk-iso-"):
            raise unauthorized("Invalid API key.")
        key_hash = hash_key(token)
        lookup = await self._lookup(key_hash)
        if lookup is None or lookup.revoked:
            raise unauthorized("Invalid or revoked API key.")
        if lookup.tenant_disabled:
            raise forbidden(f"Tenant {lookup.tenant_id!r} is disabled.")
        return Principal(lookup.tenant_id, lookup.key_id, False)

    async def require_admin(self, authorization: str | None) -> Principal:
        principal = await self.authenticate(authorization)
        if not principal.is_admin:
            raise forbidden("This endpoint needs the admin key.")
        return principal

    def forget_key(self, key_id: str) -> None:
        """Drop a key from the cache at once (after revoking it)."""
        self._forget(lambda lookup: lookup.key_id == key_id)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every key of a tenant from the cache at once (after disabling it)."""
        self._forget(lambda lookup: lookup.tenant_id == tenant_id)

    async def _lookup(self, key_hash: str) -> KeyLookup | None:
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[1] > now:
            return cached[0]
        pending = self._pending.get(key_hash)
        if pending is not None:
            try:
                return await asyncio.shield(pending)
            except Exception as exc:
                raise _store_unavailable() from exc
        future: asyncio.Future[KeyLookup | None] = asyncio.get_running_loop().create_future()
        self._pending[key_hash] = future
        try:
            lookup = await asyncio.to_thread(self._store.lookup_key, key_hash)
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters get it, nobody logs "never retrieved"
            raise _store_unavailable() from exc
        finally:
            del self._pending[key_hash]
        future.set_result(lookup)
        self._cache[key_hash] = (lookup, time.monotonic() + self._ttl_s)
        self._cache.move_to_end(key_hash)
        while len(self._cache) > _CACHE_MAX_ENTRIES:
            self._cache.popitem(last=False)
        return lookup

    def _forget(self, matches: Callable[[KeyLookup], bool]) -> None:
        stale = [
            key_hash
            for key_hash, (lookup, _) in self._cache.items()
            if lookup is not None and matches(lookup)
        ]
        for key_hash in stale:
            del self._cache[key_hash]


def _store_unavailable() -> APIError:
    return APIError(
        503, "The key store is unavailable; try again.", "service_unavailable_error",
        "auth_store_unavailable", headers={"Retry-After": "1"},
    )


def _bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
    return token
