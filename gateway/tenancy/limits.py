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

from gateway.common.errors import APIError, rate_limited
from gateway.common.redis_pipeline import RedisPipeline, redis_unreachable
from gateway.config.policies import ModelPolicy, Policies, TenantLimits

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

# KEYS: each scope's bucket hash and in-flight zset. ARGV: reserved, lease id, lease ttl (ms),
# then each scope's rpm, tpm, max_concurrent and what to take of it: "all", "count" (the request
# only, at entry) or "rest" (the concurrency slot and tokens of a request counted already).
# Every scope is checked before any is taken from, so nothing is taken unless all pass. Returns
# {0, 0, 0, then each scope's requests left and tokens left} when admitted, else {which (1
# concurrency, 2 rpm, 3 tpm), retry after (ms), the refusing scope's index}.
_ACQUIRE_BODY_LUA = """
local reserved = tonumber(ARGV[1])
local lease_ttl = tonumber(ARGV[3])
local scopes = #KEYS / 2
local rs, ts = {}, {}
for i = 1, scopes do
  local rpm = tonumber(ARGV[4 * i])
  local tpm = tonumber(ARGV[4 * i + 1])
  local max_concurrent = tonumber(ARGV[4 * i + 2])
  local mode = ARGV[4 * i + 3]
  local r, tokens = refill(KEYS[2 * i - 1], rpm, tpm, now)
  if mode ~= 'count' then
    redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now)
    if redis.call('ZCARD', KEYS[2 * i]) >= max_concurrent then
      return {1, 1000, i}
    end
  end
  if mode ~= 'rest' and r < 1 then
    return {2, math.ceil((1 - r) * 60000 / rpm), i}
  end
  if tokens < reserved then
    return {3, math.ceil((reserved - tokens) * 60000 / tpm), i}
  end
  rs[i], ts[i] = r, tokens
end
local left = {0, 0, 0}
for i = 1, scopes do
  local mode = ARGV[4 * i + 3]
  local taken = 0
  if mode ~= 'rest' then
    taken = 1
  end
  redis.call('HSET', KEYS[2 * i - 1], 'r', rs[i] - taken, 't', ts[i] - reserved, 'ts', now)
  redis.call('PEXPIRE', KEYS[2 * i - 1], 600000)
  if mode ~= 'count' then
    redis.call('ZADD', KEYS[2 * i], now + lease_ttl, ARGV[2])
    redis.call('PEXPIRE', KEYS[2 * i], lease_ttl + 60000)
  end
  left[#left + 1] = math.floor(rs[i] - taken)
  left[#left + 1] = math.floor(ts[i] - reserved)
end
return left
"""

# KEYS: each scope's bucket hash. ARGV: tokens to give back (negative: to take), then each
# scope's rpm and tpm. Each bucket is refilled first and the correction applied after, as in
# memory: giving back never fills it past the limit, and an overshoot is taken from what the
# bucket holds now.
_SETTLE_BODY_LUA = """
local delta = tonumber(ARGV[1])
for i = 1, #KEYS do
  local rpm = tonumber(ARGV[2 * i])
  local tpm = tonumber(ARGV[2 * i + 1])
  local r, tokens = refill(KEYS[i], rpm, tpm, now)
  redis.call('HSET', KEYS[i], 'r', r, 't', math.min(tpm, tokens + delta), 'ts', now)
  redis.call('PEXPIRE', KEYS[i], 600000)
end
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


@dataclass(frozen=True, slots=True)
class LimitScope:
    """One set of limits a request counts against: its tenant's (always), its model's as a
    whole (every tenant's traffic together), or its tenant's on its model. Each scope is one
    bucket and one set of leases, in Redis or in memory."""

    # The stem of its Redis keys (the hash tag in braces) and its in-memory bucket's name.
    key: str
    limits: TenantLimits
    # How a refusal and the ``x-ratelimit-scope-*`` headers name it.
    name: str = "tenant"


def tenant_scope(tenant_id: str, limits: TenantLimits) -> LimitScope:
    # The key it always had (``prefix:{tenant}:bucket``), so buckets survive an upgrade.
    return LimitScope(f"{{{tenant_id}}}", limits)


def model_scope(model: str, limits: TenantLimits) -> LimitScope:
    return LimitScope(f"{{model:{model}}}", limits, f"model {model}")


def tenant_model_scope(tenant_id: str, model: str, limits: TenantLimits) -> LimitScope:
    return LimitScope(f"{{{tenant_id}}}:model:{model}", limits, f"tenant on model {model}")


def model_scopes(policies: Policies, tenant_id: str, model: ModelPolicy) -> tuple[LimitScope, ...]:
    """The scopes a request to ``model`` counts against past its tenant's: the model's as a
    whole, then the tenant's on the model, each where the policies set one."""
    scopes: tuple[LimitScope, ...] = ()
    whole = policies.model_limits(model)
    if whole is not None:
        scopes += (model_scope(model.name, whole),)
    own = policies.tenant_model_limits(tenant_id, model)
    if own is not None:
        scopes += (tenant_model_scope(tenant_id, model.name, own),)
    return scopes


# OpenAI's ``x-ratelimit-*`` headers as header lines, filled in by one format operation.
_RATE_LIMIT_LINES = (
    b"x-ratelimit-limit-requests: %d\r\n"
    b"x-ratelimit-limit-tokens: %d\r\n"
    b"x-ratelimit-remaining-requests: %d\r\n"
    b"x-ratelimit-remaining-tokens: %d\r\n"
    b"x-ratelimit-reset-requests: %dms\r\n"
    b"x-ratelimit-reset-tokens: %dms\r\n"
)
# Which scope each figure is of, where a request counts against more than its tenant's.
_SCOPE_LINES = b"x-ratelimit-scope-requests: %s\r\nx-ratelimit-scope-tokens: %s\r\n"


def rate_limit_lines(limits: TenantLimits, left: Allowance) -> bytes:
    """OpenAI's ``x-ratelimit-*`` headers, as header lines (``name: value\\r\\n`` each): each
    limit, what is left of it, and how long until it is whole again (the buckets refill
    continuously over a minute)."""
    return _lines(limits, left, limits, left)


def _lines(
    request_limits: TenantLimits,
    requests_left: Allowance,
    token_limits: TenantLimits,
    tokens_left: Allowance,
) -> bytes:
    rpm, tpm = request_limits.requests_per_minute, token_limits.tokens_per_minute
    requests, tokens = requests_left.requests, tokens_left.tokens
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
    """One admitted request's hold on its tenant's limits, and on its model's where it has
    any (``scopes``: the tenant's first)."""

    __slots__ = (
        "_id",
        "_in_redis",
        "_limiter",
        "_limits",
        "_released",
        "_settled",
        "left",
        "reserved_tokens",
        "scope_left",
        "scopes",
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
        # The scopes past the tenant's, and what each has left once taken from.
        self.scopes: tuple[LimitScope, ...] = ()
        self.scope_left: list[Allowance] = []

    @property
    def lease_id(self) -> str:
        """The lease's name in Redis's set of leases in flight, unique across replicas: made
        when Redis first needs it (in memory the lease itself is the key)."""
        if self._id is None:
            self._id = self._limiter._new_lease_id()
        return self._id

    def all_scopes(self) -> tuple[LimitScope, ...]:
        return (tenant_scope(self.tenant_id, self._limits), *self.scopes)

    def header_lines(self) -> bytes:
        """The rate-limit headers as header lines (``rate_limit_lines``); none until known.
        Where the request counts against more than its tenant's limits, each figure is the
        binding one (the scope with the least left of it), and the scopes are named."""
        left = self.left
        if left is None:
            return b""
        if not self.scopes:
            return rate_limit_lines(self._limits, left)
        scopes = list(zip(self.all_scopes(), [left, *self.scope_left], strict=False))
        by_requests = min(scopes, key=lambda pair: pair[1].requests)
        by_tokens = min(scopes, key=lambda pair: pair[1].tokens)
        return _lines(
            by_requests[0].limits, by_requests[1], by_tokens[0].limits, by_tokens[1]
        ) + _SCOPE_LINES % (by_requests[0].name.encode(), by_tokens[0].name.encode())

    async def reserve(self, tokens: int, scopes: tuple[LimitScope, ...] = ()) -> None:
        """Take the concurrency slot and reserve the tokens of a request counted already
        (``TenantLimiter.enter``), and count it against ``scopes`` (its model's, known only once
        its body is read) whole; 429 if any is not there (the request stays counted)."""
        reserved = max(0, tokens)
        for scope in (tenant_scope(self.tenant_id, self._limits), *scopes):
            _refuse_if_too_large(reserved, scope)
        self.scopes = scopes
        limiter = self._limiter
        lefts = (
            await limiter._take_shared(self, reserved, "rest")
            if limiter._shared(self, "rest")
            else limiter._take_local(self, reserved, "rest")
        )
        requests_left, tokens_left = lefts[0]
        # Requests left as counted when this one was (the bucket has refilled a little since).
        if self.left is None:
            self.left = Allowance(requests_left, tokens_left)
        else:
            self.left.tokens = tokens_left
        self.scope_left = [Allowance(r, t) for r, t in lefts[1:]]
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
        """Give the concurrency slots back. Idempotent."""
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
        commands: RedisPipeline | None = None,
    ):
        self._redis = redis
        # Every take, settle and release goes out with the other requests' commands, one
        # round trip for all that are waiting (``gateway.common.redis_pipeline``).
        self._commands = commands if commands is not None or redis is None else RedisPipeline(redis)
        # Settles under way (``_settle_shared``), kept referenced until done.
        self._settling: set[asyncio.Future[object]] = set()
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
        self,
        tenant_id: str,
        limits: TenantLimits,
        reserved_tokens: int,
        scopes: tuple[LimitScope, ...] = (),
    ) -> LimitLease:
        """Count the request, take a concurrency slot and reserve its tokens, all or nothing,
        in the tenant's limits and in ``scopes``."""
        reserved = max(0, reserved_tokens)
        for scope in (tenant_scope(tenant_id, limits), *scopes):
            _refuse_if_too_large(reserved, scope)
        lease = LimitLease(self, tenant_id, limits, reserved)
        lease.scopes = scopes
        lefts = (
            await self._take_shared(lease, reserved, "all")
            if self._shared(lease, "all")
            else self._take_local(lease, reserved, "all")
        )
        lease.left = Allowance(*lefts[0])
        lease.scope_left = [Allowance(r, t) for r, t in lefts[1:]]
        return lease

    async def enter(self, tenant_id: str, limits: TenantLimits) -> LimitLease:
        """Count one request, before anything about it is known but its key; its concurrency
        slot and tokens are taken later (``LimitLease.reserve``)."""
        lease = LimitLease(self, tenant_id, limits, 0)
        lefts = (
            await self._take_shared(lease, 0, "count")
            if self._shared(lease, "count")
            else self._take_local(lease, 0, "count")
        )
        lease.left = Allowance(*lefts[0])
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

    # A take returns what is left of the requests and the tokens of each scope (the tenant's
    # first): pairs, not ``Allowance``s, since a request's second take only updates the tokens
    # of the one its first take made. ``mode`` is the tenant's; the other scopes are taken
    # from whole (they are first counted at the request's second take).
    async def _take_shared(
        self, lease: LimitLease, reserved: int, mode: _Mode
    ) -> list[tuple[int, int]]:
        scopes = lease.all_scopes()
        commands = self._commands
        assert self._acquire_script is not None and commands is not None  # ``_shared`` said so
        keys: list[str] = []
        args: list[str | int] = [reserved, lease.lease_id, int(self._lease_ttl_ms)]
        for index, scope in enumerate(scopes):
            keys += [self._key(scope.key, "bucket"), self._key(scope.key, "inflight")]
            limits = scope.limits
            args += [
                limits.requests_per_minute,
                limits.tokens_per_minute,
                limits.max_concurrent,
                mode if index == 0 else "all",
            ]
        try:
            verdict, retry_ms, refusing, *left = await self._with_timeout(
                commands.run_script(self._acquire_script, keys, args)
            )
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
            self._warn_fallback(exc)
        else:
            if self._warned_fallback:
                self._warned_fallback = False
                log.warning("limits: Redis reachable again; limits are shared again")
            if int(verdict):
                _raise_if_refused(int(verdict), int(retry_ms) / 1000, scopes[int(refusing) - 1])
            lease._in_redis = True
            return [(int(left[i]), int(left[i + 1])) for i in range(0, len(left), 2)]
        return self._take_local(lease, reserved, mode)  # Redis unreachable: in memory

    def _take_local(self, lease: LimitLease, reserved: int, mode: _Mode) -> list[tuple[int, int]]:
        """The script's decisions in memory, in its order: every scope checked (the concurrency
        slot, not when only counting; the request, not for the rest of a counted one; the
        tokens, always: a bucket left in debt by ``settle`` refuses even a request that
        reserves none), then every scope taken from."""
        lease._in_redis = False
        now = time.monotonic() * 1000
        scopes = lease.all_scopes()
        buckets: list[_Bucket] = []
        for index, scope in enumerate(scopes):
            limits = scope.limits
            scope_mode = mode if index == 0 else "all"
            bucket = self._buckets.get(scope.key)
            if bucket is None:
                bucket = self._buckets[scope.key] = _Bucket(
                    limits.requests_per_minute, limits.tokens_per_minute, now
                )
            bucket.refill(limits, now)
            if scope_mode != "count":
                inflight = bucket.inflight
                if len(inflight) >= limits.max_concurrent:
                    # Leases past their TTL no longer count; they can only matter at the limit,
                    # so they are looked for there, not on every request (and never exceed the
                    # limit in number).
                    for expired in [lid for lid, expiry in inflight.items() if expiry <= now]:
                        del inflight[expired]
                    if len(inflight) >= limits.max_concurrent:
                        _raise_if_refused(1, _CONCURRENCY_RETRY_S, scope)
            if scope_mode != "rest" and bucket.requests < 1:
                wait_ms = (1 - bucket.requests) * _WINDOW_MS / limits.requests_per_minute
                _raise_if_refused(2, wait_ms / 1000, scope)
            if bucket.tokens < reserved:
                wait_ms = (reserved - bucket.tokens) * _WINDOW_MS / limits.tokens_per_minute
                _raise_if_refused(3, wait_ms / 1000, scope)
            buckets.append(bucket)
        lefts: list[tuple[int, int]] = []
        for index, bucket in enumerate(buckets):
            scope_mode = mode if index == 0 else "all"
            if scope_mode != "rest":
                bucket.requests -= 1
            bucket.tokens -= reserved
            if scope_mode != "count":
                bucket.inflight[lease] = now + self._lease_ttl_ms
            lefts.append((_floor(bucket.requests), _floor(bucket.tokens)))
        return lefts

    async def _settle_shared(self, lease: LimitLease, delta: int) -> None:
        commands = self._commands
        # A lease is in Redis only if it is configured.
        assert self._settle_script is not None and commands is not None
        scopes = lease.all_scopes()
        args: list[str | int] = [delta]
        for scope in scopes:
            args += [scope.limits.requests_per_minute, scope.limits.tokens_per_minute]
        # Sent, not awaited: this process's later commands (the lease's release, the next
        # request's take) follow it on the one pipeline, so none of them can overtake it, and
        # the request need not wait a round trip of its own for it.
        keys = [self._key(scope.key, "bucket") for scope in scopes]
        settling = commands.submit_script(self._settle_script, keys, args)
        self._settling.add(settling)
        settling.add_done_callback(self._settled)

    async def drain(self) -> None:
        """Wait for the settles under way (shutdown, tests)."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    def _settled(self, done: asyncio.Future[object]) -> None:
        self._settling.discard(done)
        exc = None if done.cancelled() else done.exception()
        if exc is None:
            return
        if isinstance(exc, Exception) and redis_unreachable(exc):
            self._warn_fallback(exc)  # the reservation stands: conservative
        else:
            log.error("limits: a settle failed: %r", exc)

    def _settle_local(self, lease: LimitLease, delta: int) -> None:
        now = time.monotonic() * 1000
        for scope in lease.all_scopes():
            bucket = self._buckets.get(scope.key)
            if bucket is not None:
                limits = scope.limits
                bucket.refill(limits, now)
                bucket.tokens = min(limits.tokens_per_minute, bucket.tokens + delta)

    async def _release_shared(self, lease: LimitLease) -> None:
        commands = self._commands
        assert commands is not None  # a lease is in Redis only if it is configured
        try:
            lease_id = lease.lease_id
            removed = [
                commands.submit("ZREM", self._key(scope.key, "inflight"), lease_id)
                for scope in lease.all_scopes()
            ]
            await self._with_timeout(removed[0] if len(removed) == 1 else asyncio.gather(*removed))
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
            self._warn_fallback(exc)  # the lease expires on its own

    def _release_local(self, lease: LimitLease) -> None:
        for scope in lease.all_scopes():
            bucket = self._buckets.get(scope.key)
            if bucket is not None:
                bucket.inflight.pop(lease, None)

    def _key(self, stem: str, what: str) -> str:
        # The hash tag in the stem keeps a tenant's keys in one slot of a Redis Cluster; a
        # request with model limits takes keys of several slots (docs/operations.md).
        return f"{self._prefix}:{stem}:{what}"

    async def _with_timeout(self, call: Awaitable[_T]) -> _T:
        # A partitioned Redis must not hang admission; a refused connection fails at once.
        async with asyncio.timeout(self._redis_timeout_s):
            return await call

    def _warn_fallback(self, exc: Exception) -> None:
        # Leave Redis alone for a moment instead of paying a failed call on every request.
        self._redis_down_until = time.monotonic() + _REDIS_RETRY_S
        if not self._warned_fallback:
            self._warned_fallback = True
            log.error("limits: Redis unreachable (%r); enforcing limits per replica in memory", exc)


def _refuse_if_too_large(reserved: int, scope: LimitScope) -> None:
    limits = scope.limits
    if reserved > limits.tokens_per_minute:
        # Like OpenAI's "Request too large": a 429 that waiting alone will not cure.
        raise _scoped(
            rate_limited(
                f"Request too large: {reserved} tokens (prompt + max_tokens) exceed the "
                f"{_whose(scope)}limit of {limits.tokens_per_minute} tokens per minute; "
                "lower max_tokens or shorten the prompt.",
                60.0,
            ),
            scope,
        )


def _whose(scope: LimitScope) -> str:
    if scope.name == "tenant":
        return "tenant's "
    return f"{scope.name}'s "


def _raise_if_refused(verdict: int, retry_after_s: float, scope: LimitScope) -> None:
    if verdict == 0:
        return
    limits = scope.limits
    # The tenant's own limits keep their message; another scope's names itself.
    where = "" if scope.name == "tenant" else f" ({scope.name})"
    if verdict == 1:
        message = f"Too many concurrent requests{where}: the limit is {limits.max_concurrent}."
    elif verdict == 2:
        message = f"Rate limit reached{where}: {limits.requests_per_minute} requests per minute."
    else:
        message = f"Rate limit reached{where}: {limits.tokens_per_minute} tokens per minute."
    raise _scoped(rate_limited(message, max(retry_after_s, 0.001)), scope)


def _scoped(error: APIError, scope: LimitScope) -> APIError:
    # The binding limit named in a header too, for clients that act on it without parsing.
    error.headers["x-ratelimit-scope"] = scope.name
    return error
