"""Gate 1 across processes: KV claims every gateway process sharing one Redis counts together.

The problem: ``ClaimLedger`` makes admission a claim, not a look, inside one process. Two
processes (``--workers``, or replicas behind a load balancer) each see only their own claims,
so each can admit a prompt that fits a pool alone and not together: the incident's
precondition. A process can also die holding claims, and what it held must come back.

The invariant: a request is sent to a pair only once one atomic step in Redis (a Lua script,
loaded once and run by its hash) has found ``need`` tokens free on both of the pair's pools,
counting every live claim of every process, and recorded this request's claim there. A claim
is released when the request ends (``Claim.release`` in ``gateway.core.admission``, on every
exit path of ``Held``) and otherwise expires ``claim_ttl_s`` after its last renewal: each
process renews its own live claims every heartbeat, so the claims of a process killed while
holding them are free within one TTL. Routing (which pair is least loaded) counts every
process's claims as the last heartbeat read them; whether a request fits is the claim's alone.

Counted once, not twice: the engine's reported use already includes the requests it runs,
and a claim lives from admission to the request's end, so a running request is in both. Free
is the pool minus the *larger* of the two (as the per-process ledger does), never their sum:
the claims bound what the gateway has sent or is sending, the engine's figure what anything
else holds.

When Redis does not answer, admission fails closed (``ClaimsUnreachable``: a 503 with
Retry-After): no process can know what the others hold, and a per-process share of the pool
would need a replica count nobody can vouch for. A claim whose recording or release was lost
with Redis is not renewed by anyone and expires within one TTL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from typing import Any

from gateway.common.redis_pipeline import RedisPipeline
from gateway.workers.pairs import WorkerPair

log = logging.getLogger(__name__)

# KEYS: for each worker, its claims (hash id -> tokens) and their expiries (zset id -> ms);
# ARGV: claim id, tokens, TTL in ms, then each worker's pool and reported use. Expired claims
# are dropped first (a dead process's), then room is checked on every worker before the claim
# is recorded on any: all or nothing. Returns 1, or 0 when it does not fit. The total is summed
# from the claims each time rather than kept in a counter that could drift from them.
_CLAIM_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local id, need, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 0, #KEYS / 2 - 1 do
  local ids, expiry = KEYS[2 * i + 1], KEYS[2 * i + 2]
  -- In bounded batches: unpack has a limit, and a process may die holding many claims.
  while true do
    local expired = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 1000)
    if #expired == 0 then break end
    redis.call('HDEL', ids, unpack(expired))
    redis.call('ZREM', expiry, unpack(expired))
  end
  local total = 0
  for _, tokens in ipairs(redis.call('HVALS', ids)) do total = total + tonumber(tokens) end
  local pool, used = tonumber(ARGV[4 + 2 * i]), tonumber(ARGV[5 + 2 * i])
  if pool - math.max(used, total) < need then
    return 0
  end
end
for i = 0, #KEYS / 2 - 1 do
  local ids, expiry = KEYS[2 * i + 1], KEYS[2 * i + 2]
  redis.call('HSET', ids, id, need)
  redis.call('ZADD', expiry, now + ttl, id)
  redis.call('PEXPIRE', ids, ttl)
  redis.call('PEXPIRE', expiry, ttl)
end
return 1
"""

# KEYS: as for a claim; ARGV: the claim id.
_RELEASE_LUA = """
for i = 0, #KEYS / 2 - 1 do
  redis.call('HDEL', KEYS[2 * i + 1], ARGV[1])
  redis.call('ZREM', KEYS[2 * i + 2], ARGV[1])
end
return 1
"""

# KEYS: one worker's two keys; ARGV: TTL in ms, then (claim id, tokens) pairs, this process's
# live claims on it. A claim found missing (expired while this process stalled past the TTL)
# is recorded again: its request is still running, so its tokens are still taken. The keys
# expire with their last claim, so a deployment that stops leaves nothing behind.
_RENEW_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ids, expiry, ttl = KEYS[1], KEYS[2], tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HSET', ids, ARGV[i], ARGV[i + 1])
  redis.call('ZADD', expiry, now + ttl, ARGV[i])
end
redis.call('PEXPIRE', ids, ttl)
redis.call('PEXPIRE', expiry, ttl)
return 1
"""


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
    ) -> None:
        self._redis = redis
        # Claims and releases go out with the other requests' commands, one round trip for all
        # that are waiting (``gateway.common.redis_pipeline``); the heartbeat is its own.
        self._commands = commands if commands is not None else RedisPipeline(redis)
        self._key_prefix = key_prefix
        self.heartbeat_s = heartbeat_s
        # Three missed heartbeats: a process is dead, not slow, by then.
        self.ttl_ms = max(1, int(heartbeat_s * 3000))
        self._timeout_s = timeout_s
        self._claim = redis.register_script(_CLAIM_LUA)
        self._release = redis.register_script(_RELEASE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        # The process id in every claim's id: an operator (or a test) can tell whose it is.
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count()
        # Live claims of this process: id -> (worker URLs, tokens), what each heartbeat renews.
        self.live: dict[str, tuple[tuple[str, ...], int]] = {}
        # Releases under way, kept referenced until done.
        self._releasing: set[asyncio.Future[Any]] = set()
        # Every process's claims per worker as of the last heartbeat, for the workers routing
        # has compared: what it prefers, never what it admits on.
        self._seen: dict[str, int] = {}

    def keys(self, url: str) -> list[str]:
        stem = f"{self._key_prefix}:claims:{url}"
        return [f"{stem}:ids", f"{stem}:expiry"]

    async def claim(self, pair: WorkerPair, need: int) -> str | None:
        """Record ``need`` tokens on both of ``pair``'s pools if every process's claims leave
        room: the claim's id, or None if they do not; raises ``ClaimsUnreachable``."""
        claim_id = f"{self._owner}:{next(self._ids)}"
        keys: list[str] = []
        args: list[object] = [claim_id, need, self.ttl_ms]
        for state in (pair.prefill_state, pair.decode_state):
            keys.extend(self.keys(state.url))
            args.extend((state.max_total_num_tokens, state.used_tokens))
        try:
            async with asyncio.timeout(self._timeout_s):
                admitted = await self._commands.run_script(self._claim, keys, args)
        except Exception as exc:  # whatever Redis did, nothing is known: fail closed
            # If the claim was recorded after all, nobody renews it: it expires within a TTL.
            raise ClaimsUnreachable(f"{type(exc).__name__}: {exc}") from exc
        if not admitted:
            return None
        self.live[claim_id] = (pair.urls, need)
        return claim_id

    def release(self, claim_id: str) -> None:
        """Take the claim off in Redis, in the background: the request is over either way, and
        a release that fails is no longer renewed, so it expires within a TTL."""
        entry = self.live.pop(claim_id, None)
        if entry is None:
            return
        keys = [key for url in entry[0] for key in self.keys(url)]
        try:
            # Submitted, not awaited (no task of its own): the request is over either way.
            released = self._commands.submit_script(self._release, keys, [claim_id])
        except RuntimeError:  # no loop left (shutdown): a release must not fail its request
            return  # not renewed any more: it expires within a TTL
        self._releasing.add(released)
        released.add_done_callback(lambda done: self._released(done, claim_id))

    def _released(self, done: asyncio.Future[Any], claim_id: str) -> None:
        self._releasing.discard(done)
        if not done.cancelled() and (exc := done.exception()) is not None:
            log.warning("claims: release of %s left to expire: %s", claim_id, exc)

    def seen(self, url: str) -> int:
        """Every process's claims on the worker as of the last heartbeat (0 until one has read
        them); asking makes the heartbeats read them."""
        seen = self._seen.get(url)
        if seen is None:
            self._seen[url] = seen = 0
        return seen

    async def renew(self) -> None:
        """One heartbeat: every live claim of this process renewed, per worker; then every
        process's claims read for the workers routing compares."""
        per_worker: dict[str, list[object]] = {}
        for claim_id, (urls, tokens) in self.live.items():
            for url in urls:
                per_worker.setdefault(url, []).extend((claim_id, tokens))
        watched = list(self._seen)
        if not per_worker and not watched:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for url, entries in per_worker.items():
                await self._renew(keys=self.keys(url), args=[self.ttl_ms, *entries], client=pipe)
            for url in watched:
                pipe.hvals(self.keys(url)[0])
            replies = await pipe.execute()
        # Expired claims not yet dropped are counted too: an overestimate, for a preference.
        for url, tokens in zip(watched, replies[len(per_worker) :], strict=True):
            self._seen[url] = sum(int(value) for value in tokens)

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self.renew()
            except Exception as exc:  # never let the heartbeat die; a missed beat is survivable
                log.warning("claims: heartbeat failed: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def drain(self) -> None:
        """Wait for the releases under way (shutdown, tests)."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
