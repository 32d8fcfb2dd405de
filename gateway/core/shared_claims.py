"""Gate 1 across processes: KV claims every gateway process sharing one Redis counts together.

The problem: ``ClaimLedger`` makes admission a claim, not a look, inside one process. Two
processes (``--workers``, or replicas behind a load balancer) each see only their own claims,
so each can admit a prompt that fits a pool alone and not together: the incident's
precondition. A process can also die holding claims, and what it held must come back. And a
Redis round trip for every request's claim (and another for its release) costs a process more
CPU and latency than everything else the request does.

The lease: per worker, each process holds room leased from Redis (``leased[url]`` tokens,
recorded as one entry, ``{owner}:lease``, among every process's entries for that worker) and
admits requests into it locally, counting them in ``in_use[url]``; a release is local too.
Only a request the lease cannot hold goes to Redis: one atomic step (a Lua script, loaded once
and run by its hash) grows the leases on both of the pair's workers, or neither, by what the
request lacks plus one spare block (``lease_block`` of the worker's pool), or, when that does
not fit, by exactly what it lacks. Each heartbeat renews the leases and shrinks each to what is
in use, plus one block where a request was admitted since the last heartbeat.

The invariant: ``in_use[url] <= leased[url]`` in every process, and a lease grows only by a
delta that one atomic step has found free on the worker: ``pool - max(used, total) >= delta``,
``total`` being every process's leases there (expired ones dropped first). So the requests
every process has admitted never exceed any pool, exactly as when each request claimed in
Redis. Locally a lease is lowered before Redis is told, and raised only once Redis has
recorded it; the heartbeat's and the top-ups' writes are serialized, so Redis never holds less
than the process admits into.

What a lease costs the others: room this process released stays in its lease until its next
heartbeat, unless a release leaves more than two blocks unused (a large request ended: a prompt
that needs its room may come to another process next), which shrinks the lease at once, in the
background; an idle process gives its lease back within two heartbeats (one block spare, then
none). So at most two blocks per process are withheld, for at most one heartbeat.

Counted once, not twice: the engine's reported use already includes the requests it runs, and
a lease covers them from admission to their end, so a running request is in both. Free is the
pool minus the *larger* of the two (as the per-process ledger does), never their sum.

A process killed holding a lease renews it no more: the entry expires ``claim_ttl`` (three
heartbeats) after its last renewal, so its room is free within one TTL. A lease found expired
at a renewal (the process stalled past the TTL, or Redis lost it) is recorded again for the
requests still running, not for its spare.

Failing closed: when Redis does not answer a top-up, admission fails closed
(``ClaimsUnreachable``: a 503 with Retry-After): no process can know what the others hold,
and a per-process share of the pool would need a replica count nobody can vouch for. A lease
is trusted locally only until one heartbeat before its entry could have expired in Redis
(measured on the monotonic clock from when its last successful renewal or top-up was sent);
past that the process admits nothing locally on that worker and goes to Redis, which fails
closed if it does not answer. Otherwise another process could claim room this one still
admits into.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from typing import Any

from gateway.common.redis_pipeline import RedisPipeline
from gateway.workers.pairs import WorkerPair

log = logging.getLogger(__name__)

# KEYS: for each worker, its entries (hash id -> tokens) and their expiries (zset id -> ms);
# ARGV: lease id, TTL in ms, then for each worker its pool, its reported use, the lease wanted
# (with a spare block) and the least lease this request needs (without it). Expired entries
# are dropped first (a dead process's), then room is checked on every worker before any lease
# is recorded: all or nothing, with the spare if it fits everywhere, else without. Returns 2
# (recorded with the spare), 1 (without) or 0 (it does not fit). The total is summed from the
# entries each time rather than kept in a counter that could drift from them.
_LEASE_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local id, ttl = ARGV[1], tonumber(ARGV[2])
local workers = #KEYS / 2
local room, held = {}, {}
for i = 0, workers - 1 do
  local ids, expiry = KEYS[2 * i + 1], KEYS[2 * i + 2]
  -- In bounded batches: unpack has a limit, and a process may die holding many entries.
  while true do
    local expired = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 1000)
    if #expired == 0 then break end
    redis.call('HDEL', ids, unpack(expired))
    redis.call('ZREM', expiry, unpack(expired))
  end
  local total = 0
  for _, tokens in ipairs(redis.call('HVALS', ids)) do total = total + tonumber(tokens) end
  local pool, used = tonumber(ARGV[3 + 4 * i]), tonumber(ARGV[4 + 4 * i])
  room[i] = pool - math.max(used, total)
  held[i] = tonumber(redis.call('HGET', ids, id) or 0)
end
local function fits(offset)
  for i = 0, workers - 1 do
    local delta = tonumber(ARGV[offset + 4 * i]) - held[i]
    if delta > 0 and delta > room[i] then return false end
  end
  return true
end
local granted, offset = 0, 0
if fits(5) then granted, offset = 2, 5 elseif fits(6) then granted, offset = 1, 6 else return 0 end
for i = 0, workers - 1 do
  local ids, expiry = KEYS[2 * i + 1], KEYS[2 * i + 2]
  redis.call('HSET', ids, id, ARGV[offset + 4 * i])
  redis.call('ZADD', expiry, now + ttl, id)
  redis.call('PEXPIRE', ids, ttl)
  redis.call('PEXPIRE', expiry, ttl)
end
return granted
"""

# KEYS: one worker's two keys; ARGV: lease id, TTL in ms, the lease to keep and what of it is
# in use. A lease found expired (this process stalled past the TTL, or Redis lost it) is
# recorded again for what is in use only: those requests still run, but its spare may have
# been claimed meanwhile. 0 deletes the entry. Returns what was recorded. The keys expire with
# their last entry, so a deployment that stops leaves nothing behind.
_RENEW_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ids, expiry = KEYS[1], KEYS[2]
local id, ttl, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local expires = redis.call('ZSCORE', expiry, id)
if not expires or tonumber(expires) <= now then keep = tonumber(ARGV[4]) end
if keep <= 0 then
  redis.call('HDEL', ids, id)
  redis.call('ZREM', expiry, id)
  return 0
end
redis.call('HSET', ids, id, keep)
redis.call('ZADD', expiry, now + ttl, id)
redis.call('PEXPIRE', ids, ttl)
redis.call('PEXPIRE', expiry, ttl)
return keep
"""

# Top-ups one claim may make: another request of this process can take the room one top-up
# granted before this one gets to it (only while the top-up was on the wire).
_TOP_UPS = 3


class ClaimsUnreachable(Exception):
    """Redis did not answer a claim: admission fails closed."""


class SharedClaims:
    """This process's side of the claims every process counts together (see the module doc)."""

    def __init__(
        self,
        redis: Any,
        key_prefix: str,
        *,
        heartbeat_s: float,
        timeout_s: float = 1.0,
        commands: RedisPipeline | None = None,
        lease_block: float = 1 / 16,
    ) -> None:
        self._redis = redis
        # Top-ups go out with the other requests' commands, one round trip for all that are
        # waiting (``gateway.common.redis_pipeline``); the heartbeat is its own.
        self._commands = commands if commands is not None else RedisPipeline(redis)
        self._key_prefix = key_prefix
        self.heartbeat_s = heartbeat_s
        # Three missed heartbeats: a process is dead, not slow, by then.
        self.ttl_ms = max(1, int(heartbeat_s * 3000))
        # A lease is trusted locally one heartbeat less than it lives in Redis.
        self._trusted_s = self.ttl_ms / 1000 - heartbeat_s
        self._timeout_s = timeout_s
        self._lease_block = lease_block
        self._lease = redis.register_script(_LEASE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        # The process id in every entry's id: an operator (or a test) can tell whose it is.
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lease_id = f"{self._owner}:lease"
        self._ids = itertools.count()
        # Live claims of this process: id -> (worker URLs, tokens).
        self.live: dict[str, tuple[tuple[str, ...], int]] = {}
        # Per worker: the room leased (as Redis holds it, or less), what live claims use of
        # it, the spare block a top-up adds, until when it may be admitted into (monotonic).
        self.leased: dict[str, int] = {}
        self.in_use: dict[str, int] = {}
        self._blocks: dict[str, int] = {}
        self._trusted_until: dict[str, float] = {}
        # Workers a request was admitted on since the last heartbeat: they keep a block spare.
        self._admitted: set[str] = set()
        # Every write of a lease (top-ups, heartbeats): Redis sees them in the order they
        # change the local figures.
        self._writing = asyncio.Lock()
        # A shrink a large release started, running (or None).
        self._shrinking: asyncio.Task[None] | None = None
        # Top-ups that found Redis unreachable: one waiting behind a failed one fails at once.
        self._failures = 0
        # Every process's entries per worker as of the last heartbeat, for the workers routing
        # has compared: what it prefers, never what it admits on.
        self._seen: dict[str, int] = {}

    def keys(self, url: str) -> list[str]:
        stem = f"{self._key_prefix}:claims:{url}"
        return [f"{stem}:ids", f"{stem}:expiry"]

    async def claim(self, pair: WorkerPair, need: int) -> str | None:
        """Claim ``need`` tokens on both of ``pair``'s pools, within this process's leases or by
        growing them if every process's leases leave room: the claim's id, or None if they do
        not; raises ``ClaimsUnreachable``."""
        if self._room(pair.urls, need, time.monotonic()):
            return self._take(pair.urls, need)
        failures = self._failures
        async with self._writing:
            for _ in range(_TOP_UPS):
                if self._room(pair.urls, need, time.monotonic()):
                    return self._take(pair.urls, need)
                if self._failures != failures:
                    raise ClaimsUnreachable("a top-up waited on found Redis unreachable")
                if not await self._top_up(pair, need):
                    return None
            if self._room(pair.urls, need, time.monotonic()):
                return self._take(pair.urls, need)
        return None

    def _room(self, urls: tuple[str, ...], need: int, now: float) -> bool:
        leased, in_use, trusted = self.leased, self.in_use, self._trusted_until
        for url in urls:
            if trusted.get(url, 0.0) <= now or leased.get(url, 0) - in_use.get(url, 0) < need:
                return False
        return True

    def _take(self, urls: tuple[str, ...], need: int) -> str:
        in_use = self.in_use
        for url in urls:
            in_use[url] = in_use.get(url, 0) + need
        self._admitted.update(urls)
        claim_id = f"{self._owner}:{next(self._ids)}"
        self.live[claim_id] = (urls, need)
        return claim_id

    async def _top_up(self, pair: WorkerPair, need: int) -> bool:
        """Grow the leases on both of the pair's workers so that ``need`` more fits (with a
        spare block if there is room for it): whether Redis granted it."""
        keys: list[str] = []
        args: list[object] = [self._lease_id, self.ttl_ms]
        wanted: list[tuple[str, int, int]] = []
        for state in (pair.prefill_state, pair.decode_state):
            url, pool = state.url, state.max_total_num_tokens
            block = self._blocks[url] = int(pool * self._lease_block)
            leased, taken = self.leased.get(url, 0), self.in_use.get(url, 0) + need
            # A lease that already holds it is sent unchanged: the call renews its trust.
            least, want = max(leased, taken), max(leased, taken + block)
            keys.extend(self.keys(url))
            args.extend((pool, state.used_tokens, want, least))
            wanted.append((url, want, least))
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s):
                granted = await self._commands.run_script(self._lease, keys, args)
        except Exception as exc:  # whatever Redis did, nothing is known: fail closed
            # A growth recorded after all is not in the local lease: it expires within a TTL.
            self._failures += 1
            raise ClaimsUnreachable(f"{type(exc).__name__}: {exc}") from exc
        if not granted:
            return False
        for url, want, least in wanted:
            self.leased[url] = want if granted == 2 else least
            self._trusted_until[url] = sent + self._trusted_s
        return True

    def release(self, claim_id: str) -> None:
        """Give the claim's tokens back to this process's leases: no Redis (the next
        heartbeat returns what is no longer needed)."""
        entry = self.live.pop(claim_id, None)
        if entry is None:
            return
        urls, tokens = entry
        in_use, leased, blocks = self.in_use, self.leased, self._blocks
        for url in urls:
            in_use[url] -= tokens
        if self._shrinking is None and any(
            leased.get(url, 0) - in_use[url] > 2 * blocks.get(url, 0) for url in urls
        ):
            try:
                self._shrinking = asyncio.get_running_loop().create_task(self._shrink())
            except RuntimeError:  # no loop left (shutdown): the lease expires within a TTL
                pass

    async def _shrink(self) -> None:
        """A heartbeat's shrink now: a large request's room goes back to every process."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self.renew()
        except Exception as exc:  # the next heartbeat does it
            log.warning("claims: shrink after a release failed: %s", exc)
        finally:
            self._shrinking = None

    def seen(self, url: str) -> int:
        """Every process's leases on the worker as of the last heartbeat (0 until one has read
        them); asking makes the heartbeats read them."""
        seen = self._seen.get(url)
        if seen is None:
            self._seen[url] = seen = 0
        return seen

    async def renew(self) -> None:
        """One heartbeat: every lease of this process renewed and shrunk to what is in use,
        plus a block where a request was admitted since the last one; then every process's
        leases read for the workers routing compares."""
        await self._beat(spare=True)

    async def _beat(self, *, spare: bool) -> None:
        watched = list(self._seen)
        async with self._writing:
            admitted, self._admitted = self._admitted, set()
            kept: list[tuple[str, int, int]] = []
            for url, leased in list(self.leased.items()):
                in_use = self.in_use.get(url, 0)
                block = self._blocks.get(url, 0) if spare and url in admitted else 0
                keep = max(in_use, min(leased, in_use + block))
                self.leased[url] = keep  # lowered here before Redis: never above what it holds
                kept.append((url, keep, in_use))
            if not kept and not watched:
                return
            sent = time.monotonic()
            async with self._redis.pipeline(transaction=False) as pipe:
                for url, keep, in_use in kept:
                    args = [self._lease_id, self.ttl_ms, keep, in_use]
                    await self._renew(keys=self.keys(url), args=args, client=pipe)
                for url in watched:
                    pipe.hvals(self.keys(url)[0])
                replies = await pipe.execute()
            for (url, _, _), recorded in zip(kept, replies, strict=False):
                self.leased[url] = int(recorded)
                if recorded:
                    self._trusted_until[url] = sent + self._trusted_s
                elif not self.in_use.get(url):
                    self._forget(url)
        # Expired entries not yet dropped are counted too: an overestimate, for a preference.
        for url, tokens in zip(watched, replies[len(kept) :], strict=True):
            self._seen[url] = sum(int(value) for value in tokens)

    def _forget(self, url: str) -> None:
        for figures in (self.leased, self.in_use, self._blocks, self._trusted_until):
            figures.pop(url, None)

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self.renew()
            except Exception as exc:  # never let the heartbeat die; a missed beat is survivable
                log.warning("claims: heartbeat failed: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def drain(self) -> None:
        """Give back the leased room no request of this process uses (shutdown): one round
        trip; if Redis does not answer, it expires within a TTL."""
        if self._shrinking is not None:
            await asyncio.gather(self._shrinking, return_exceptions=True)
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._beat(spare=False)
        except Exception as exc:
            log.warning("claims: leases left to expire: %s", exc)
