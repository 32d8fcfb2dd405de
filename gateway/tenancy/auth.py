"""API key → tenant.

Keys are 256-bit random tokens (``sk-iso-...``) stored only as their SHA-256. A presented
key is hashed and looked up in a small in-memory cache first; the database is asked only on
a miss, from a thread. Cache entries live ``settings.auth_cache_ttl_s``: a key revoked (or a
tenant disabled) is forgotten at once (``forget_key``, ``forget_tenant``) by the replica that
made the change and, through Redis, by every other (``gateway.tenancy.revocations``); without Redis,
other replicas within the TTL. Unknown keys are cached too
(negatively), so a client retrying a bad key does not reach the database on every request;
a new key is a fresh random token, so no negative entry can stand in its way.

While the store cannot be reached, a key this process saw valid within
``settings.auth_stale_if_error_s`` keeps working (stale-if-error): a database outage must
not take the serving path down with it. Unknown keys are refused (503) meanwhile, and a
revocation through this process still takes effect at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.common.errors import APIError, forbidden, rate_limited, unauthorized
from gateway.config.settings import Settings
from gateway.tenancy.store import ADMIN_TENANT_ID, KeyLookup

if TYPE_CHECKING:
    from gateway.tenancy.store import Store

log = logging.getLogger("isogate.auth")

ADMIN_KEY_ID = "admin"
# While the key store is down, ask it again at most this often.
_STORE_RETRY_S = 1.0
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
        self._stale_if_error_s = settings.auth_stale_if_error_s
        self._store_down_until = 0.0
        # Compared as digests so the comparison's time does not depend on the key's length.
        self._admin_digest = (
            hashlib.sha256(settings.admin_key.encode()).digest() if settings.admin_key else None
        )
        # key hash → (lookup result or None for unknown, expiry on the monotonic clock)
        self._cache: OrderedDict[str, tuple[KeyLookup | None, float]] = OrderedDict()
        # Concurrent misses on one key share one database lookup.
        self._pending: dict[str, asyncio.Future[KeyLookup | None]] = {}
        # Bumped by every forget: a lookup that began before one may have read what it forgot,
        # so its answer is returned but not cached.
        self._forgets = 0

    async def authenticate(self, authorization: str | None) -> Principal:
        token = _bearer_token(authorization)
        digest = hashlib.sha256(token.encode()).digest()
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return ADMIN_PRINCIPAL
        if not token.startswith("sk-iso-"):
            raise unauthorized("Invalid API key.")
        lookup = await self._lookup(digest.hex())  # = hash_key(token), without hashing twice
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

    def expire_all(self) -> None:
        """Make every entry ask the store again on its next use (kept for stale-if-error)."""
        now = time.monotonic()
        for key_hash, (lookup, expires_at) in self._cache.items():
            if expires_at > now:
                self._cache[key_hash] = (lookup, now)

    async def _lookup(self, key_hash: str) -> KeyLookup | None:
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None:
            lookup, expires_at = cached
            if expires_at > now:
                return lookup
            # Expired. While the store is known to be down, a key seen valid recently is
            # served from the cache without waiting on the store again.
            if now < self._store_down_until and self._may_serve_stale(lookup, expires_at, now):
                return lookup
        pending = self._pending.get(key_hash)
        if pending is not None:
            try:
                return await asyncio.shield(pending)
            except Exception as exc:
                raise _store_unavailable() from exc
        future: asyncio.Future[KeyLookup | None] = asyncio.get_running_loop().create_future()
        self._pending[key_hash] = future
        forgets = self._forgets
        try:
            lookup = await asyncio.to_thread(self._store.lookup_key, key_hash)
        except Exception as exc:
            self._note_store_down(exc)
            if cached is not None and self._may_serve_stale(cached[0], cached[1], time.monotonic()):
                future.set_result(cached[0])
                return cached[0]
            future.set_exception(exc)
            future.exception()  # retrieved: waiters get it, nobody logs "never retrieved"
            raise _store_unavailable() from exc
        finally:
            del self._pending[key_hash]
        if self._store_down_until:
            self._store_down_until = 0.0
            log.warning("auth: key store reachable again")
        future.set_result(lookup)
        if forgets != self._forgets:
            return lookup
        self._cache[key_hash] = (lookup, time.monotonic() + self._ttl_s)
        self._cache.move_to_end(key_hash)
        while len(self._cache) > _CACHE_MAX_ENTRIES:
            self._cache.popitem(last=False)
        return lookup

    def _may_serve_stale(self, lookup: KeyLookup | None, expires_at: float, now: float) -> bool:
        # Only keys that were valid: an unknown or revoked key is never let in on stale data.
        return (
            lookup is not None
            and not lookup.revoked
            and not lookup.tenant_disabled
            and now - expires_at < self._stale_if_error_s
        )

    def _note_store_down(self, exc: Exception) -> None:
        if not self._store_down_until:
            log.error(
                "auth: key store unreachable (%s); serving recently valid keys from cache", exc
            )
        self._store_down_until = time.monotonic() + _STORE_RETRY_S

    def _forget(self, matches: Callable[[KeyLookup], bool]) -> None:
        self._forgets += 1
        stale = [
            key_hash
            for key_hash, (lookup, _) in self._cache.items()
            if lookup is not None and matches(lookup)
        ]
        for key_hash in stale:
            del self._cache[key_hash]


def _store_unavailable() -> APIError:
    return APIError(
        503,
        "The key store is unavailable; try again.",
        "service_unavailable_error",
        "auth_store_unavailable",
        headers={"Retry-After": "1"},
    )


def _bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
    return token


class RefusalCounter(Protocol):
    def unauthenticated(self, code: str) -> None: ...


class UnauthenticatedClients:
    """What a request that fails authentication costs: a count, a sampled log line, and one
    token of its client address's allowance, never an audit row (anyone could write those).

    An address that spent its allowance (``per_minute``, refilled continuously, per replica) is
    answered 429 before its key is even looked at, so a flood of made-up keys stops costing key
    lookups. Valid keys from that address wait too, for as long as it keeps failing.
    """

    def __init__(self, metrics: RefusalCounter, *, per_minute: int, log_every_s: float = 1.0):
        self._metrics = metrics
        self._per_minute = float(per_minute)
        self._log_every_s = log_every_s
        self._logged_at = 0.0
        self._unlogged = 0
        # address -> (allowance left, when it was last refilled); least recently failed first out
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def check(self, address: str) -> None:
        """429 while ``address`` has no allowance left."""
        bucket = self._buckets.get(address)
        if bucket is None:
            return
        left = self._refilled(bucket, time.monotonic())
        if left < 1:
            self._metrics.unauthenticated("rate_limit_exceeded")
            raise rate_limited(
                "Too many unauthenticated requests from this address; send a valid API key.",
                (1 - left) * 60 / self._per_minute,
            )

    def refused(self, address: str, error: APIError) -> None:
        """Count a failed authentication against ``address``."""
        now = time.monotonic()
        bucket = self._buckets.get(address)
        left = self._per_minute if bucket is None else self._refilled(bucket, now)
        self._buckets[address] = (left - 1, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > _CACHE_MAX_ENTRIES:
            self._buckets.popitem(last=False)
        self._metrics.unauthenticated(error.code or str(error.status))
        # Sampled: one line a second at most, with how many were not logged.
        if now - self._logged_at >= self._log_every_s:
            log.info(
                "unauthenticated request refused",
                extra={"client": address, "code": error.code, "not_logged": self._unlogged},
            )
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1

    def _refilled(self, bucket: tuple[float, float], now: float) -> float:
        left, at = bucket
        return min(self._per_minute, left + (now - at) * self._per_minute / 60)
