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

Failed authentications are limited per client address (``UnauthenticatedClients``), but only
the failures: a key is always looked up before its address's allowance is consulted, so other
clients failing at the same address never refuse a valid key. What keeps a flood of made-up
keys from reaching the store is the negative cache and, for an address that spent its
allowance, one store lookup at a time for keys not known valid.
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
    # The models this key may call, narrowing its tenant's; None: the tenant's.
    models: tuple[str, ...] | None = None


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

    async def authenticate(
        self, authorization: str | None, *, pace: asyncio.Lock | None = None
    ) -> Principal:
        """The principal of ``authorization``; 401 or 403 if it has none. With ``pace`` (its
        client address keeps failing: ``UnauthenticatedClients``), a key not known valid waits
        for ``pace`` before the store is asked about it."""
        token = _bearer_token(authorization)
        digest = hashlib.sha256(token.encode()).digest()
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return ADMIN_PRINCIPAL
        if not token.startswith("sk-iso-"):
            raise unauthorized("Invalid API key.")
        lookup = await self._lookup(digest.hex(), pace)  # = hash_key(token), hashed once
        if lookup is None or lookup.revoked:
            raise unauthorized("Invalid or revoked API key.")
        if lookup.tenant_disabled:
            raise forbidden(f"Tenant {lookup.tenant_id!r} is disabled.")
        return Principal(lookup.tenant_id, lookup.key_id, False, lookup.models)

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

    async def _lookup(self, key_hash: str, pace: asyncio.Lock | None = None) -> KeyLookup | None:
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
        if pace is not None and not (cached is not None and _valid(cached[0])):
            # One store lookup at a time for this address; meanwhile the cache, or a lookup of
            # the same key begun by another request, may have the answer.
            async with pace:
                return await self._lookup(key_hash)
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
        return _valid(lookup) and now - expires_at < self._stale_if_error_s

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


def _valid(lookup: KeyLookup | None) -> bool:
    return lookup is not None and not lookup.revoked and not lookup.tenant_disabled


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

    Every key is looked up before the allowance is consulted: a valid key is served whatever
    other clients at its address did. An address that spent its allowance (``per_minute``,
    refilled continuously, per replica) is answered 429 for its failures, and the store is
    asked about its keys one lookup at a time (keys this process knows valid skip the line;
    a key refused recently is answered from the negative cache without a lookup). So a flood
    of made-up keys from one address costs the store one lookup in flight, not one per
    request, and a new valid key from that address waits its turn rather than being refused.

    ``address`` is the client's as the server saw it: behind a trusted proxy, the one the
    proxy forwards (uvicorn's ``forwarded_allow_ips``, ``gateway.cli.main``).
    """

    def __init__(self, metrics: RefusalCounter, *, per_minute: int, log_every_s: float = 1.0):
        self._metrics = metrics
        self._per_minute = float(per_minute)
        self._log_every_s = log_every_s
        self._logged_at = 0.0
        self._unlogged = 0
        # address -> (allowance left, when it was last refilled); least recently failed first out
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # address -> its line for store lookups and how many requests are using it; an entry
        # lives only while a request of an address that spent its allowance is authenticating.
        self._paces: dict[str, tuple[asyncio.Lock, int]] = {}

    async def authenticate(
        self, authenticator: Authenticator, authorization: str | None, address: str
    ) -> Principal:
        """``authenticator``'s principal for ``authorization``; a failure is counted against
        ``address``, and answered 429 instead once the address has spent its allowance."""
        pace = self._take_pace(address) if self.spent(address) else None
        try:
            return await authenticator.authenticate(authorization, pace=pace)
        except APIError as error:
            if error.status not in (401, 403):
                raise
            refusal = self.refused(address, error)
            if refusal is error:
                raise
            raise refusal from None
        finally:
            if pace is not None:
                self._give_pace(address)

    def spent(self, address: str) -> bool:
        """Whether ``address`` has no allowance left now."""
        bucket = self._buckets.get(address)
        return bucket is not None and self._refilled(bucket, time.monotonic()) < 1

    def refused(self, address: str, error: APIError) -> APIError:
        """Count a failed authentication against ``address``; what to answer: ``error``, or a
        429 once the address has no allowance left (then not counted further, so it refills
        as soon as the failures stop)."""
        now = time.monotonic()
        bucket = self._buckets.get(address)
        left = self._per_minute if bucket is None else self._refilled(bucket, now)
        spent = left < 1
        self._buckets[address] = (left if spent else left - 1, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > _CACHE_MAX_ENTRIES:
            self._buckets.popitem(last=False)
        if spent:
            self._metrics.unauthenticated("rate_limit_exceeded")
            return rate_limited(
                "Too many failed authentications from this address; send a valid API key.",
                (1 - left) * 60 / self._per_minute,
            )
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
        return error

    def _take_pace(self, address: str) -> asyncio.Lock:
        lock, users = self._paces.get(address) or (asyncio.Lock(), 0)
        self._paces[address] = (lock, users + 1)
        return lock

    def _give_pace(self, address: str) -> None:
        lock, users = self._paces[address]
        if users == 1:
            del self._paces[address]
        else:
            self._paces[address] = (lock, users - 1)

    def _refilled(self, bucket: tuple[float, float], now: float) -> float:
        left, at = bucket
        return min(self._per_minute, left + (now - at) * self._per_minute / 60)
