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
a tenant's limits together. Each process takes from Redis in shares (a request's need and a
spare) and spends them without a round trip until they run short
(``gateway.tenancy.limit_shares``); with no spare, every take is the request's own, exactly
the algorithm memory runs. Without Redis, that algorithm runs in process memory. If
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
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from gateway.common.errors import APIError, rate_limited
from gateway.common.redis_pipeline import RedisPipeline, redis_unreachable
from gateway.config.policies import ModelPolicy, Policies, TenantLimits
from gateway.tenancy.limit_shares import (
    Share,
    Taking,
    all_unspent,
    least_and_most,
    over_spare,
    spare_of,
    take_from,
)

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
# With Redis, the most of each limit a process holds unspent (``gateway.tenancy.limit_shares``).
DEFAULT_SPARE_FRACTION = 1 / 64
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

# KEYS: each scope's bucket hash and in-flight zset. ARGV: the take's id (its slots are named
# after it), the slot TTL (ms), then for each scope its rpm, tpm and max_concurrent, and the
# least and the most to take of its requests, its tokens and its slots (``limit_shares``: the
# least is what the request lacks, the most adds the process's spare). Every scope is checked
# for its least before any is taken from, so nothing is taken unless all pass; a bucket left
# in debt by a settle refuses even a take of no tokens. Returns {0, 0, 0, then per scope the
# requests and tokens left, and the requests, tokens and slots taken} when admitted, else
# {which (1 concurrency, 2 rpm, 3 tpm), retry after (ms), the refusing scope's index}.
_ACQUIRE_BODY_LUA = """
local take_id = ARGV[1]
local slot_ttl = tonumber(ARGV[2])
local scopes = #KEYS / 2
local rs, ts, free = {}, {}, {}
for i = 1, scopes do
  local a = 9 * i - 7
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local max_concurrent = tonumber(ARGV[a + 3])
  local least_r, least_t = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 6])
  local least_s = tonumber(ARGV[a + 8])
  local r, tokens = refill(KEYS[2 * i - 1], rpm, tpm, now)
  local held = 0
  if least_s > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now)
    held = redis.call('ZCARD', KEYS[2 * i])
    if held + least_s > max_concurrent then
      return {1, 1000, i}
    end
  end
  if r < least_r then
    return {2, math.ceil((least_r - r) * 60000 / rpm), i}
  end
  if tokens < least_t then
    return {3, math.ceil((least_t - tokens) * 60000 / tpm), i}
  end
  rs[i], ts[i], free[i] = r, tokens, max_concurrent - held
end
local out = {0, 0, 0}
for i = 1, scopes do
  local a = 9 * i - 7
  local took_r = math.max(tonumber(ARGV[a + 4]), math.min(tonumber(ARGV[a + 5]), math.floor(rs[i])))
  local took_t = math.max(tonumber(ARGV[a + 6]), math.min(tonumber(ARGV[a + 7]), math.floor(ts[i])))
  redis.call('HSET', KEYS[2 * i - 1], 'r', rs[i] - took_r, 't', ts[i] - took_t, 'ts', now)
  redis.call('PEXPIRE', KEYS[2 * i - 1], 600000)
  local took_s = 0
  if tonumber(ARGV[a + 8]) > 0 then
    took_s = math.max(tonumber(ARGV[a + 8]), math.min(tonumber(ARGV[a + 9]), free[i]))
    for k = 1, took_s do
      redis.call('ZADD', KEYS[2 * i], now + slot_ttl, take_id .. ':' .. i .. ':' .. k)
    end
    redis.call('PEXPIRE', KEYS[2 * i], slot_ttl + 60000)
  end
  out[#out + 1] = math.floor(rs[i] - took_r)
  out[#out + 1] = math.floor(ts[i] - took_t)
  out[#out + 1] = took_r
  out[#out + 1] = took_t
  out[#out + 1] = took_s
end
return out
"""

# KEYS: each scope's bucket hash. ARGV: each scope's rpm and tpm, and the requests and tokens
# to give back (negative: to take). Each bucket is refilled first and the correction applied
# after, as in memory: giving back never fills it past the limit, and an overshoot is taken
# from what the bucket holds now.
_SETTLE_BODY_LUA = """
for i = 1, #KEYS do
  local rpm, tpm = tonumber(ARGV[4 * i - 3]), tonumber(ARGV[4 * i - 2])
  local r, tokens = refill(KEYS[i], rpm, tpm, now)
  r = math.min(rpm, r + tonumber(ARGV[4 * i - 1]))
  tokens = math.min(tpm, tokens + tonumber(ARGV[4 * i]))
  redis.call('HSET', KEYS[i], 'r', r, 't', tokens, 'ts', now)
  redis.call('PEXPIRE', KEYS[i], 600000)
end
return 0
"""

# KEYS: one scope's in-flight zset. ARGV: the slot TTL (ms), then the slot members this process
# holds there: each is given a new expiry, and recorded again if it had expired meanwhile.
_RENEW_SLOTS_BODY_LUA = """
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) + 60000)
return 0
"""


_RENEW_SLOTS_LUA = _REDIS_NOW_LUA + _RENEW_SLOTS_BODY_LUA


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
        "_in_redis",
        "_limiter",
        "_limits",
        "_released",
        "_settled",
        "_slots",
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
        self._in_redis = False
        # In Redis: the slot this lease holds of each scope's share (scope key, slot member).
        self._slots: list[tuple[str, str]] = []
        self._settled = False
        self._released = False
        self.left: Allowance | None = None  # what the tenant may still send, when known
        # The scopes past the tenant's, and what each has left once taken from.
        self.scopes: tuple[LimitScope, ...] = ()
        self.scope_left: list[Allowance] = []

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
                self._limiter._settle_shared(self, delta)
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
        spare_fraction: float = DEFAULT_SPARE_FRACTION,
        heartbeat_s: float = 1.0,
    ):
        self._redis = redis
        # What Redis is still asked goes out with the other requests' commands, one round trip
        # for all that are waiting (``gateway.common.redis_pipeline``).
        self._commands = commands if commands is not None or redis is None else RedisPipeline(redis)
        # With Redis: this process's share of each scope (``gateway.tenancy.limit_shares``).
        self._shares: dict[str, Share] = {}
        self._spare_fraction = spare_fraction
        self.heartbeat_s = heartbeat_s
        self._renewed_at = time.monotonic()
        # Give-backs under way (settles, shares returned), kept referenced until done.
        self._settling: set[asyncio.Future[Any]] = set()
        self._prefix = key_prefix
        self._lease_ttl_ms = lease_ttl_s * 1000
        self._buckets: dict[str, _Bucket] = {}
        self._acquire_script = redis.register_script(_ACQUIRE_LUA) if redis is not None else None
        self._settle_script = redis.register_script(_SETTLE_LUA) if redis is not None else None
        self._renew_script = redis.register_script(_RENEW_SLOTS_LUA) if redis is not None else None
        self._warned_fallback = False
        self._redis_timeout_s = redis_timeout_s
        self._redis_down_until = 0.0
        # Take IDs (slots are named after them): unique across replicas (a random prefix per
        # limiter) without a system call for randomness per request.
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
        """Take from this process's shares what they hold, and what they lack from Redis in one
        round trip (with a spare for the next requests); nothing is taken unless all is."""
        scopes = lease.all_scopes()
        takings: list[Taking] = []
        for index, scope in enumerate(scopes):
            scope_mode = mode if index == 0 else "all"
            share = self._share(scope)
            takings.append(
                take_from(share, int(scope_mode != "rest"), reserved, scope_mode != "count")
            )
        if any(taking.lacks() for taking in takings):
            try:
                await self._top_up(scopes, takings)
            except BaseException as exc:  # refused, Redis gone, or the request cancelled
                for taking in takings:
                    taking.undo()
                if not isinstance(exc, Exception) or not redis_unreachable(exc):
                    raise  # a refusal (APIError), a cancellation, or a bug
                self._warn_fallback(exc)
                return self._take_local(lease, reserved, mode)  # Redis unreachable: in memory
            if self._warned_fallback:
                self._warned_fallback = False
                log.warning("limits: Redis reachable again; limits are shared again")
        lease._in_redis = True
        lease._slots = [
            (scope.key, taking.slot)
            for scope, taking in zip(scopes, takings, strict=True)
            if taking.slot is not None
        ]
        return [
            (taking.share.bucket_requests + taking.share.requests,
             taking.share.bucket_tokens + taking.share.tokens)
            for taking in takings
        ]  # fmt: skip

    def _share(self, scope: LimitScope) -> Share:
        share = self._shares.get(scope.key)
        if share is None:
            share = self._shares[scope.key] = Share(scope.limits)
        share.limits = scope.limits  # a policy reload applies from the next take on
        return share

    async def _top_up(self, scopes: tuple[LimitScope, ...], takings: list[Taking]) -> None:
        """Ask Redis for what each scope's share lacks, plus its spare; 429 if any lacks more
        than its limits have left."""
        commands = self._commands
        assert self._acquire_script is not None and commands is not None  # ``_shared`` said so
        take_id = self._new_lease_id()
        keys: list[str] = []
        args: list[str | int] = [take_id, int(self._lease_ttl_ms)]
        asked: list[tuple[LimitScope, Taking]] = []
        for scope, taking in zip(scopes, takings, strict=True):
            if not taking.lacks():
                continue
            limits, spare = scope.limits, spare_of(scope.limits, self._spare_fraction)
            keys += [self._key(scope.key, "bucket"), self._key(scope.key, "inflight")]
            args += [
                limits.requests_per_minute,
                limits.tokens_per_minute,
                limits.max_concurrent,
                *least_and_most(taking.lack_requests, spare.requests),
                *least_and_most(taking.lack_tokens, spare.tokens),
                *least_and_most(taking.lack_slot, spare.slots),
            ]
            asked.append((scope, taking))
        reply = commands.submit_script(self._acquire_script, keys, args)
        try:
            verdict, retry_ms, refusing, *figures = await self._with_timeout(asyncio.shield(reply))
        except BaseException:
            # Cut short (a timeout, the client gone): what Redis grants even so goes to the
            # shares, to be spent or given back, rather than lost (its slots held to their TTL).
            reply.add_done_callback(lambda done: self._keep_granted(done, take_id, asked))
            raise
        if int(verdict):
            _raise_if_refused(int(verdict), int(retry_ms) / 1000, asked[int(refusing) - 1][0])
        for index, (_, taking) in enumerate(asked):
            left_r, left_t, took_r, took_t, took_s = (
                int(f) for f in figures[5 * index : 5 * index + 5]
            )
            taking.got(left_r, left_t, took_r, took_t, _slot_names(take_id, index, took_s))
        # Two requests of this process may have topped up one share at once.
        self._give_back([scope.key for scope, _ in asked], wait=False)

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

    def _keep_granted(
        self, done: asyncio.Future[Any], take_id: str, asked: list[tuple[LimitScope, Taking]]
    ) -> None:
        """A top-up nobody waits for any more: whatever Redis granted joins the shares."""
        if done.cancelled() or done.exception() is not None or int(done.result()[0]):
            return
        figures = done.result()[3:]
        for index, (scope, _) in enumerate(asked):
            _, _, took_r, took_t, took_s = (int(f) for f in figures[5 * index : 5 * index + 5])
            share = self._share(scope)
            share.requests += took_r
            share.tokens += took_t
            share.free_slots.extend(_slot_names(take_id, index, took_s))
        self._give_back([scope.key for scope, _ in asked], wait=False)

    def _settle_shared(self, lease: LimitLease, delta: int) -> None:
        """The correction goes to this process's shares; what they then hold past their spare
        (or owe) goes to Redis, sent, not awaited: this process's later commands (a release,
        the next request's take) follow it on the one pipeline, so none of them can overtake
        it, and the request need not wait a round trip of its own for it."""
        keys = []
        for scope in lease.all_scopes():
            self._share(scope).tokens += delta
            keys.append(scope.key)
        self._give_back(keys, wait=False)

    def _give_back(
        self, keys: list[str], *, wait: bool, idle: bool = False
    ) -> asyncio.Future[Any] | None:
        """Send Redis what the scopes' shares hold past their spare (everything unspent with
        ``idle``): requests and tokens to their buckets, slots out of the set in flight. The
        future of it, or None when there was nothing to send. ``wait`` is whether the caller
        awaits it; otherwise it is kept referenced until done."""
        commands = self._commands
        assert self._settle_script is not None and commands is not None
        buckets: list[str] = []
        args: list[str | int] = []
        sent: list[asyncio.Future[Any]] = []
        for key in keys:
            share = self._shares.get(key)
            if share is None:
                continue
            limits = share.limits
            requests, tokens, slots = (
                all_unspent(share)
                if idle
                else over_spare(share, spare_of(limits, self._spare_fraction))
            )
            if requests or tokens:
                buckets.append(self._key(key, "bucket"))
                args += [limits.requests_per_minute, limits.tokens_per_minute, requests, tokens]
            if slots:
                sent.append(commands.submit("ZREM", self._key(key, "inflight"), *slots))
        if buckets:
            sent.append(commands.submit_script(self._settle_script, buckets, args))
        if not sent:
            return None
        future = sent[0] if len(sent) == 1 else asyncio.gather(*sent)
        if not wait:
            self._settling.add(future)
            future.add_done_callback(self._settled)
        return future

    async def drain(self) -> None:
        """Wait for the give-backs under way (shutdown, tests)."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    def _settled(self, done: asyncio.Future[Any]) -> None:
        self._settling.discard(done)
        exc = None if done.cancelled() else done.exception()
        if exc is None:
            return
        if isinstance(exc, Exception) and redis_unreachable(exc):
            self._warn_fallback(exc)  # the reservation stands, the slots expire: conservative
        else:
            log.error("limits: a give-back failed: %r", exc)

    async def heartbeat(self) -> None:
        """Give back every share not spent from since the last heartbeat, forget the empty
        ones, and renew the slots this process holds before their TTL runs out."""
        idle = [key for key, share in self._shares.items() if not share.spent]
        for share in self._shares.values():
            share.spent = False
        given = self._give_back(idle, wait=True, idle=True)
        for key in idle:
            if self._shares[key].empty():
                del self._shares[key]
        renewals: list[asyncio.Future[Any]] = []
        if time.monotonic() - self._renewed_at >= self._lease_ttl_ms / 3000:
            self._renewed_at = time.monotonic()
            commands = self._commands
            assert self._renew_script is not None and commands is not None
            for key, share in self._shares.items():
                if held := [*share.free_slots, *share.busy_slots]:
                    inflight = self._key(key, "inflight")
                    args = [int(self._lease_ttl_ms), *held]
                    renewals.append(commands.submit_script(self._renew_script, [inflight], args))
        await asyncio.gather(*([given] if given else []), *renewals)

    async def close(self) -> None:
        """Give every share back (shutdown): what this process holds, the others may use now,
        not after it expires; then wait for the give-backs under way."""
        if self._shares and self._commands is not None:
            for share in self._shares.values():
                share.spent = False
            try:
                async with asyncio.timeout(self._redis_timeout_s):
                    await self.heartbeat()
            except Exception as exc:  # the slots expire, the tokens are lost: conservative
                log.warning("limits: shares not given back at shutdown: %r", exc)
        await self.drain()

    async def run(self) -> None:
        """The heartbeat, for as long as the process serves (with Redis only)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if time.monotonic() < self._redis_down_until:
                continue
            try:
                async with asyncio.timeout(max(self.heartbeat_s, self._redis_timeout_s)):
                    await self.heartbeat()
            except Exception as exc:  # a missed beat is survivable: never let it die
                if redis_unreachable(exc):
                    # Told now, not when a share runs short: the requests that follow take from
                    # memory, as when a take finds Redis gone.
                    self._warn_fallback(exc)
                else:
                    log.warning("limits: heartbeat failed: %r", exc)

    def _settle_local(self, lease: LimitLease, delta: int) -> None:
        now = time.monotonic() * 1000
        for scope in lease.all_scopes():
            bucket = self._buckets.get(scope.key)
            if bucket is not None:
                limits = scope.limits
                bucket.refill(limits, now)
                bucket.tokens = min(limits.tokens_per_minute, bucket.tokens + delta)

    async def _release_shared(self, lease: LimitLease) -> None:
        """The slots go back to this process's shares; what they then hold past their spare
        leaves the set in flight before the answer is sent, so that a client that waits for
        its answer never meets its own slot still held."""
        keys: list[str] = []
        for key, member in lease._slots:
            share = self._shares.get(key)
            if share is None:
                continue  # never: a share holding a busy slot is not forgotten
            share.busy_slots.discard(member)
            share.free_slots.append(member)
            keys.append(key)
        given = self._give_back(keys, wait=True) if keys else None
        if given is None:
            return
        try:
            await self._with_timeout(given)
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
            self._warn_fallback(exc)  # the slot expires on its own

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


def _slot_names(take_id: str, index: int, count: int) -> list[str]:
    """The members the acquire script added for the ``index``-th scope it was asked about (as
    it names them: the take's id, the scope's place from 1, the slot's from 1)."""
    return [f"{take_id}:{index + 1}:{k}" for k in range(1, count + 1)]


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
