"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

RPM and TPM are token buckets that hold one minute's allowance and refill continuously
(``limit / 60`` per second), so a tenant may burst up to its per-minute limit and then
proceeds at the limit's rate. A request takes one RPM token as soon as its key is known
(``enter``, before its body is even read: a tenant out of requests gets 429 however cheap or
broken its bodies are), and a concurrency slot and ``prompt + max_tokens`` TPM tokens at
admission (``LimitLease.reserve``); ``acquire`` takes all three at once. ``settle`` gives back what
it did not use (or takes the overshoot, leaving the bucket in debt). Concurrency is a set of
leases that expire after ``lease_ttl_s``, so a replica that dies holding slots does not
hold them forever.

With Redis, one Lua script checks all three limits and takes from them atomically (nothing
is taken unless all three pass), using Redis's clock, so any number of gateway replicas hold
a tenant's limits together. Without Redis, the same algorithm runs in process memory. If
Redis becomes unreachable, each replica falls back to its in-memory limiter (logged) rather
than refusing every request: limits are about fairness, not isolation.

Limits are passed on every call, so a policy reload takes effect on the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from gateway.common.errors import rate_limited
from gateway.config.policies import TenantLimits

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("isogate.limits")

_T = TypeVar("_T")
# What one limiter call takes: everything, the request only (at entry), or the rest.
_Mode = Literal["all", "count", "rest"]

_WINDOW_MS = 60_000.0
_floor = math.floor
# Retry hint when the concurrency limit is reached: when a slot frees is unknown.
_CONCURRENCY_RETRY_S = 1.0
# After Redis failed, the in-memory limiter alone is used for this long before Redis is tried again.
_REDIS_RETRY_S = 1.0

# The scripts are composed from parts so that the refill is written once for both. ``now`` is
# Redis's clock (so replicas share one), in milliseconds; ``refill`` is the bucket's state at
# ``now`` and the in-memory ``_Bucket.refill`` is the same arithmetic in the same order
# (tests/tenancy/test_limits.py drives both with one clock and compares every decision).
_REDIS_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

# Each allowance grows by its limit every minute, continuously, and never past the limit.
# Returns the requests and tokens the bucket hash `key` holds at `now` (a missing one is full).
_REFILL_LUA = """
local function refill(key, rpm, tpm, now)
  local state = redis.call('HMGET', key, 'r', 't', 'ts')
  local r = tonumber(state[1]) or rpm
  local tokens = tonumber(state[2]) or tpm
  local ts = tonumber(state[3]) or now
  local elapsed = math.max(0, now - ts)
  return math.min(rpm, r + elapsed * rpm / 60000), math.min(tpm, tokens + elapsed * tpm / 60000)
end
"""

# KEYS: bucket hash, in-flight zset. ARGV: rpm, tpm, max_concurrent, reserved, lease id,
# lease ttl (ms), and what to take: "all" (default), "count" (the request only, at entry) or
# "rest" (the concurrency slot and tokens of a request counted already). Returns {0, 0,
# requests left, tokens left} when admitted, else {which (1 concurrency, 2 rpm, 3 tpm),
# retry after (ms)}.
_ACQUIRE_BODY_LUA = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local max_concurrent = tonumber(ARGV[3])
local reserved = tonumber(ARGV[4])
local lease_ttl = tonumber(ARGV[6])
local mode = ARGV[7] or 'all'
local r, tokens = refill(KEYS[1], rpm, tpm, now)
if mode ~= 'count' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_concurrent then
    return {1, 1000}
  end
end
local taken = 0
if mode ~= 'rest' then
  if r < 1 then
    return {2, math.ceil((1 - r) * 60000 / rpm)}
  end
  taken = 1
end
if tokens < reserved then
  return {3, math.ceil((reserved - tokens) * 60000 / tpm)}
end
redis.call('HSET', KEYS[1], 'r', r - taken, 't', tokens - reserved, 'ts', now)
redis.call('PEXPIRE', KEYS[1], 600000)
if mode ~= 'count' then
  redis.call('ZADD', KEYS[2], now + lease_ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], lease_ttl + 60000)
end
return {0, 0, math.floor(r - taken), math.floor(tokens - reserved)}
"""

# KEYS: bucket hash. ARGV: rpm, tpm, tokens to give back (negative: to take). The bucket is
# refilled first and the correction applied after, as in memory: giving back never fills it
# past the limit, and an overshoot is taken from what the bucket holds now.
_SETTLE_BODY_LUA = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local delta = tonumber(ARGV[3])
local r, tokens = refill(KEYS[1], rpm, tpm, now)
redis.call('HSET', KEYS[1], 'r', r, 't', math.min(tpm, tokens + delta), 'ts', now)
redis.call('PEXPIRE', KEYS[1], 600000)
return 0
"""


def limiter_scripts(now: str = _REDIS_NOW_LUA) -> tuple[str, str]:
    """The acquire and settle scripts: ``now`` (Lua that sets ``now``, in ms), the one refill,
    then each script's body. Production reads Redis's clock; a test may give another clock."""
    return now + _REFILL_LUA + _ACQUIRE_BODY_LUA, now + _REFILL_LUA + _SETTLE_BODY_LUA


_ACQUIRE_LUA, _SETTLE_LUA = limiter_scripts()


@dataclass(slots=True)
class _Bucket:
    requests: float
    tokens: float
    at_ms: float
    # Leases in flight → expiry (ms); in memory the lease itself is the key (no name to make).
    inflight: dict[LimitLease, float] = field(default_factory=dict)

    def refill(self, limits: TenantLimits, now_ms: float) -> None:
        # The Lua ``refill`` of the Redis path, term for term (held equal by a test); its
        # ``math.max`` and ``math.min`` as comparisons (no built-in called, on every request).
        elapsed = now_ms - self.at_ms
        if elapsed < 0.0:
            elapsed = 0.0
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        requests = self.requests + elapsed * rpm / _WINDOW_MS
        tokens = self.tokens + elapsed * tpm / _WINDOW_MS
        self.requests = rpm if rpm <= requests else requests
        self.tokens = tpm if tpm <= tokens else tokens
        self.at_ms = now_ms


@dataclass(slots=True)  # built per request: not frozen (see gateway.core.generation)
class Allowance:
    """What a tenant may still send once a request was admitted, as OpenAI reports it."""

    requests: int
    tokens: int


# OpenAI's ``x-ratelimit-*`` headers as header lines, filled in by one format operation.
_RATE_LIMIT_LINES = (
    b"x-ratelimit-limit-requests: %d\r\n"
    b"x-ratelimit-limit-tokens: %d\r\n"
    b"x-ratelimit-remaining-requests: %d\r\n"
    b"x-ratelimit-remaining-tokens: %d\r\n"
    b"x-ratelimit-reset-requests: %dms\r\n"
    b"x-ratelimit-reset-tokens: %dms\r\n"
)


def rate_limit_lines(limits: TenantLimits, left: Allowance) -> bytes:
    """OpenAI's ``x-ratelimit-*`` headers, as header lines (``name: value\\r\\n`` each): each
    limit, what is left of it, and how long until it is whole again (the buckets refill
    continuously over a minute)."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    requests, tokens = left.requests, left.tokens
    requests, tokens = (requests if requests > 0 else 0), (tokens if tokens > 0 else 0)
    return _RATE_LIMIT_LINES % (
        rpm,
        tpm,
        requests,
        tokens,
        (rpm - requests) * 60_000 // rpm,
        (tpm - tokens) * 60_000 // tpm,
    )


class LimitLease:
    """One admitted request's hold on its tenant's limits."""

    __slots__ = (
        "_id",
        "_in_redis",
        "_limiter",
        "_limits",
        "_released",
        "_settled",
        "left",
        "reserved_tokens",
        "tenant_id",
    )

    def __init__(
        self, limiter: TenantLimiter, tenant_id: str, limits: TenantLimits, reserved: int
    ) -> None:
        self.tenant_id = tenant_id
        self.reserved_tokens = reserved
        self._limiter = limiter
        self._limits = limits
        self._id: str | None = None
        self._in_redis = False
        self._settled = False
        self._released = False
        self.left: Allowance | None = None  # what the tenant may still send, when known

    @property
    def lease_id(self) -> str:
        """The lease's name in Redis's set of leases in flight, unique across replicas: made
        when Redis first needs it (in memory the lease itself is the key)."""
        if self._id is None:
            self._id = self._limiter._new_lease_id()
        return self._id

    def header_lines(self) -> bytes:
        """The rate-limit headers as header lines (``rate_limit_lines``); none until known."""
        return b"" if self.left is None else rate_limit_lines(self._limits, self.left)

    async def reserve(self, tokens: int) -> None:
        """Take the concurrency slot and reserve the tokens of a request counted already
        (``TenantLimiter.enter``); 429 if either is not there (the request stays counted)."""
        reserved = max(0, tokens)
        _refuse_if_too_large(reserved, self._limits)
        limiter = self._limiter
        requests_left, tokens_left = (
            await limiter._take_shared(self, reserved, "rest")
            if limiter._shared(self, "rest")
            else limiter._take_local(self, reserved, "rest")
        )
        # Requests left as counted when this one was (the bucket has refilled a little since).
        if self.left is None:
            self.left = Allowance(requests_left, tokens_left)
        else:
            self.left.tokens = tokens_left
        self.reserved_tokens = reserved

    async def settle(self, actual_tokens: int) -> None:
        """Correct the TPM reservation to the real count (once; later calls do nothing)."""
        if self._settled:
            return
        self._settled = True
        delta = self.reserved_tokens - max(0, actual_tokens)
        if delta:
            if self._in_redis:
                await self._limiter._settle_shared(self, delta)
            else:
                self._limiter._settle_local(self, delta)

    async def release(self) -> None:
        """Give the concurrency slot back. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._in_redis:
            await self._limiter._release_shared(self)
        else:
            self._limiter._release_local(self)

    async def __aenter__(self) -> LimitLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


class TenantLimiter:
    def __init__(
        self,
        redis: redis.asyncio.Redis | None,
        key_prefix: str = "isogate",
        *,
        lease_ttl_s: float = 900.0,
        redis_timeout_s: float = 0.5,
    ):
        self._redis = redis
        self._prefix = key_prefix
        self._lease_ttl_ms = lease_ttl_s * 1000
        self._buckets: dict[str, _Bucket] = {}
        self._acquire_script = redis.register_script(_ACQUIRE_LUA) if redis is not None else None
        self._settle_script = redis.register_script(_SETTLE_LUA) if redis is not None else None
        self._warned_fallback = False
        self._redis_timeout_s = redis_timeout_s
        self._redis_down_until = 0.0
        # Lease IDs: unique across replicas (a random prefix per limiter) without a system call
        # for randomness per request.
        self._lease_prefix = secrets.token_hex(8)
        self._lease_numbers = itertools.count()

    async def acquire(
        self, tenant_id: str, limits: TenantLimits, reserved_tokens: int
    ) -> LimitLease:
        """Count the request, take a concurrency slot and reserve its tokens, all or nothing."""
        reserved = max(0, reserved_tokens)
        _refuse_if_too_large(reserved, limits)
        lease = LimitLease(self, tenant_id, limits, reserved)
        requests_left, tokens_left = (
            await self._take_shared(lease, reserved, "all")
            if self._shared(lease, "all")
            else self._take_local(lease, reserved, "all")
        )
        lease.left = Allowance(requests_left, tokens_left)
        return lease

    async def enter(self, tenant_id: str, limits: TenantLimits) -> LimitLease:
        """Count one request, before anything about it is known but its key; its concurrency
        slot and tokens are taken later (``LimitLease.reserve``)."""
        lease = LimitLease(self, tenant_id, limits, 0)
        requests_left, tokens_left = (
            await self._take_shared(lease, 0, "count")
            if self._shared(lease, "count")
            else self._take_local(lease, 0, "count")
        )
        lease.left = Allowance(requests_left, tokens_left)
        return lease

    def _new_lease_id(self) -> str:
        return f"{self._lease_prefix}{next(self._lease_numbers):x}"

    # Each take is shared (Redis, awaited) or local (in memory, not a coroutine: the local
    # path is taken without one more frame to resume per step).
    def _shared(self, lease: LimitLease, mode: _Mode) -> bool:
        """Whether this take goes to Redis: it is configured and not known to be down, and a
        lease's later steps go where its first one went."""
        return (
            self._acquire_script is not None
            and time.monotonic() >= self._redis_down_until
            and (mode != "rest" or lease._in_redis)
        )

    # A take returns what is left of the requests and the tokens: a pair, not an ``Allowance``,
    # since a request's second take only updates the tokens of the one its first take made.
    async def _take_shared(self, lease: LimitLease, reserved: int, mode: _Mode) -> tuple[int, int]:
        tenant_id, limits = lease.tenant_id, lease._limits
        assert self._acquire_script is not None  # ``_shared`` said so
        try:
            verdict, retry_ms, *left = await self._with_timeout(
                self._acquire_script(
                    keys=[self._key(tenant_id, "bucket"), self._key(tenant_id, "inflight")],
                    args=[
                        limits.requests_per_minute,
                        limits.tokens_per_minute,
                        limits.max_concurrent,
                        reserved,
                        lease.lease_id,
                        int(self._lease_ttl_ms),
                        mode,
                    ],
                )
            )
        except Exception as exc:
            if not _redis_unreachable(exc):
                raise
            self._warn_fallback(exc)
        else:
            if self._warned_fallback:
                self._warned_fallback = False
                log.warning("limits: Redis reachable again; limits are shared again")
            _raise_if_refused(int(verdict), int(retry_ms) / 1000, limits)
            lease._in_redis = True
            return int(left[0]), int(left[1])
        return self._take_local(lease, reserved, mode)  # Redis unreachable: in memory

    def _take_local(self, lease: LimitLease, reserved: int, mode: _Mode) -> tuple[int, int]:
        """The script's decisions in memory, in its order: the concurrency slot (not when only
        counting), the request (not for the rest of a counted one), the tokens (always: a
        bucket left in debt by ``settle`` refuses even a request that reserves none)."""
        lease._in_redis = False
        limits = lease._limits
        now = time.monotonic() * 1000
        bucket = self._buckets.get(lease.tenant_id)
        if bucket is None:
            bucket = self._buckets[lease.tenant_id] = _Bucket(
                limits.requests_per_minute, limits.tokens_per_minute, now
            )
        bucket.refill(limits, now)
        counted = mode != "rest"
        if mode != "count":
            inflight = bucket.inflight
            if len(inflight) >= limits.max_concurrent:
                # Leases past their TTL no longer count; they can only matter at the limit, so
                # they are looked for there, not on every request (and never exceed the limit
                # in number).
                for expired in [lid for lid, expiry in inflight.items() if expiry <= now]:
                    del inflight[expired]
                if len(inflight) >= limits.max_concurrent:
                    _raise_if_refused(1, _CONCURRENCY_RETRY_S, limits)
        if counted and bucket.requests < 1:
            wait_ms = (1 - bucket.requests) * _WINDOW_MS / limits.requests_per_minute
            _raise_if_refused(2, wait_ms / 1000, limits)
        if bucket.tokens < reserved:
            wait_ms = (reserved - bucket.tokens) * _WINDOW_MS / limits.tokens_per_minute
            _raise_if_refused(3, wait_ms / 1000, limits)
        if counted:
            bucket.requests -= 1
        bucket.tokens -= reserved
        if mode != "count":
            bucket.inflight[lease] = now + self._lease_ttl_ms
        return _floor(bucket.requests), _floor(bucket.tokens)

    async def _settle_shared(self, lease: LimitLease, delta: int) -> None:
        limits = lease._limits
        assert self._settle_script is not None  # a lease is in Redis only if it is configured
        try:
            await self._with_timeout(
                self._settle_script(
                    keys=[self._key(lease.tenant_id, "bucket")],
                    args=[limits.requests_per_minute, limits.tokens_per_minute, delta],
                )
            )
        except Exception as exc:
            if not _redis_unreachable(exc):
                raise
            self._warn_fallback(exc)  # the reservation stands: conservative

    def _settle_local(self, lease: LimitLease, delta: int) -> None:
        limits = lease._limits
        bucket = self._buckets.get(lease.tenant_id)
        if bucket is not None:
            now = time.monotonic() * 1000
            bucket.refill(limits, now)
            bucket.tokens = min(limits.tokens_per_minute, bucket.tokens + delta)

    async def _release_shared(self, lease: LimitLease) -> None:
        assert self._redis is not None  # a lease is in Redis only if it is configured
        try:
            await self._with_timeout(
                self._redis.zrem(self._key(lease.tenant_id, "inflight"), lease.lease_id)
            )
        except Exception as exc:
            if not _redis_unreachable(exc):
                raise
            self._warn_fallback(exc)  # the lease expires on its own

    def _release_local(self, lease: LimitLease) -> None:
        bucket = self._buckets.get(lease.tenant_id)
        if bucket is not None:
            bucket.inflight.pop(lease, None)

    def _key(self, tenant_id: str, what: str) -> str:
        # The hash tag keeps a tenant's keys in one slot of a Redis Cluster (one script).
        return f"{self._prefix}:{{{tenant_id}}}:{what}"

    async def _with_timeout(self, call: Awaitable[_T]) -> _T:
        # A partitioned Redis must not hang admission; a refused connection fails at once.
        return await asyncio.wait_for(call, timeout=self._redis_timeout_s)

    def _warn_fallback(self, exc: Exception) -> None:
        # Leave Redis alone for a moment instead of paying a failed call on every request.
        self._redis_down_until = time.monotonic() + _REDIS_RETRY_S
        if not self._warned_fallback:
            self._warned_fallback = True
            log.error("limits: Redis unreachable (%r); enforcing limits per replica in memory", exc)


def _refuse_if_too_large(reserved: int, limits: TenantLimits) -> None:
    if reserved > limits.tokens_per_minute:
        # Like OpenAI's "Request too large": a 429 that waiting alone will not cure.
        raise rate_limited(
            f"Request too large: {reserved} tokens (prompt + max_tokens) exceed the "
            f"tenant's limit of {limits.tokens_per_minute} tokens per minute; "
            "lower max_tokens or shorten the prompt.",
            60.0,
        )


def _raise_if_refused(verdict: int, retry_after_s: float, limits: TenantLimits) -> None:
    if verdict == 0:
        return
    if verdict == 1:
        message = f"Too many concurrent requests: the limit is {limits.max_concurrent}."
    elif verdict == 2:
        message = f"Rate limit reached: {limits.requests_per_minute} requests per minute."
    else:
        message = f"Rate limit reached: {limits.tokens_per_minute} tokens per minute."
    raise rate_limited(message, max(retry_after_s, 0.001))


def _redis_unreachable(exc: Exception) -> bool:
    import redis.exceptions

    return isinstance(
        exc,
        (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
            asyncio.TimeoutError,
        ),
    )
