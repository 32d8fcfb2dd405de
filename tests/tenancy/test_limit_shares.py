"""A process's shares of its tenants' limits, against the real Redis (gateway.tenancy.limit_shares).

Each ``TenantLimiter`` here stands for one gateway process; every test has its own key prefix.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.common.errors import APIError
from gateway.common.redis_pipeline import RedisPipeline
from gateway.config.policies import TenantLimits
from gateway.tenancy.limit_shares import spare_of
from gateway.tenancy.limits import DEFAULT_SPARE_FRACTION, TenantLimiter

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


class CountingPipeline(RedisPipeline):
    """The limiter's pipeline, counting its round trips to Redis."""

    round_trips = 0

    async def _round_trip(self, batch: list[Any]) -> list[Any]:
        self.round_trips += 1
        return await super()._round_trip(batch)


def process(redis: Any, prefix: str) -> tuple[TenantLimiter, CountingPipeline]:
    commands = CountingPipeline(redis)
    return TenantLimiter(redis, key_prefix=prefix, commands=commands), commands


async def bucket_tokens(redis: Any, prefix: str, tenant: str) -> float:
    return float(await redis.hget(f"{prefix}:{{{tenant}}}:bucket", "t"))


async def slots_in_redis(redis: Any, prefix: str, tenant: str) -> int:
    return int(await redis.zcard(f"{prefix}:{{{tenant}}}:inflight"))


# Large enough that each spare is many requests' worth: 1,000 requests, 100,000 tokens, 64 slots.
LARGE = TenantLimits(requests_per_minute=64_000, tokens_per_minute=6_400_000, max_concurrent=6_400)


async def test_requests_within_a_share_ask_redis_nothing(
    redis_client: Any, redis_prefix: str
) -> None:
    limiter, commands = process(redis_client, redis_prefix)
    for _ in range(50):
        lease = await limiter.acquire("acme", LARGE, 100)
        await lease.settle(60)
        await lease.release()
    await limiter.drain()
    # The first request took a share; the other 49 spent it.
    assert commands.round_trips == 1


async def test_what_a_process_holds_and_what_redis_holds_add_up_to_the_limit(
    redis_client: Any, redis_prefix: str
) -> None:
    limiter, _ = process(redis_client, redis_prefix)
    spare = spare_of(LARGE, DEFAULT_SPARE_FRACTION)
    started = time.monotonic()
    # Twenty requests run short of the share at once: each tops it up with a spare.
    leases = await asyncio.gather(*(limiter.acquire("acme", LARGE, 500) for _ in range(20)))
    await limiter.drain()
    share = limiter._shares["{acme}"]
    assert 0 < share.tokens <= 2 * spare.tokens
    assert 0 < share.requests <= 2 * spare.requests
    in_redis = await bucket_tokens(redis_client, redis_prefix, "acme")
    refilled = LARGE.tokens_per_minute * (time.monotonic() - started) / 60
    # Nothing made, nothing lost, but what the bucket refilled while the test ran.
    held = in_redis + share.tokens + 20 * 500
    assert LARGE.tokens_per_minute <= held <= LARGE.tokens_per_minute + refilled + 1
    for lease in leases:
        await lease.release()


async def test_a_share_left_unspent_for_a_heartbeat_goes_back_to_the_other_processes(
    redis_client: Any, redis_prefix: str
) -> None:
    limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=64_000, max_concurrent=100)
    spare = spare_of(limits, DEFAULT_SPARE_FRACTION).tokens
    first, _ = process(redis_client, redis_prefix)
    second, _ = process(redis_client, redis_prefix)
    await first.acquire("acme", limits, spare)  # takes twice that: the request and a spare
    await second.acquire("acme", limits, 64_000 - 2 * spare)  # all the bucket has left
    with pytest.raises(APIError) as refused:
        await second.acquire("acme", limits, spare)
    assert refused.value.status == 429  # the first process holds it
    await first.heartbeat()  # it spent from its share since the last heartbeat: kept
    with pytest.raises(APIError):
        await second.acquire("acme", limits, spare)
    await first.heartbeat()  # a heartbeat unspent: given back
    await second.acquire("acme", limits, spare)


async def test_slots_released_past_twice_the_spare_leave_redis_before_release_returns(
    redis_client: Any, redis_prefix: str
) -> None:
    limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=10**9, max_concurrent=640)
    spare = spare_of(limits, DEFAULT_SPARE_FRACTION).slots
    limiter, _ = process(redis_client, redis_prefix)
    leases = await asyncio.gather(*(limiter.acquire("acme", limits, 1) for _ in range(30)))
    await limiter.drain()
    for lease in leases:
        await lease.release()
    # Back to the share (its spare), the rest out of Redis: another process may take them.
    assert await slots_in_redis(redis_client, redis_prefix, "acme") <= 2 * spare
    await limiter.heartbeat()
    await limiter.heartbeat()
    assert await slots_in_redis(redis_client, redis_prefix, "acme") == 0


async def test_a_take_cut_short_while_on_the_wire_keeps_what_redis_granted_for_the_share(
    redis_client: Any, redis_prefix: str
) -> None:
    limiter, _ = process(redis_client, redis_prefix)
    cut = asyncio.create_task(limiter.acquire("acme", LARGE, 100))
    await asyncio.sleep(0)  # its top-up is on the wire
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut
    await asyncio.sleep(0.1)  # the reply arrives for nobody
    await limiter.close()
    # Given back with the share: no slot held in Redis until its TTL, no token lost.
    assert await slots_in_redis(redis_client, redis_prefix, "acme") == 0
    assert await bucket_tokens(redis_client, redis_prefix, "acme") >= LARGE.tokens_per_minute


async def test_a_process_shutting_down_gives_its_shares_back(
    redis_client: Any, redis_prefix: str
) -> None:
    limiter, _ = process(redis_client, redis_prefix)
    lease = await limiter.acquire("acme", LARGE, 100)
    await lease.settle(100)
    await lease.release()
    await limiter.close()
    assert await slots_in_redis(redis_client, redis_prefix, "acme") == 0
    assert await bucket_tokens(redis_client, redis_prefix, "acme") >= LARGE.tokens_per_minute - 100


async def test_a_limit_with_no_spare_is_taken_and_given_back_in_redis_request_by_request(
    redis_client: Any, redis_prefix: str
) -> None:
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=1000, max_concurrent=2)
    limiter = TenantLimiter(redis_client, key_prefix=redis_prefix, spare_fraction=0)
    other = TenantLimiter(redis_client, key_prefix=redis_prefix, spare_fraction=0)
    lease = await limiter.acquire("acme", limits, 400)
    await lease.settle(100)
    await limiter.drain()
    # The other process sees at once what this one gave back and released.
    await other.acquire("acme", limits, 900)
    await lease.release()
    assert await slots_in_redis(redis_client, redis_prefix, "acme") == 1


async def test_a_held_slot_is_renewed_at_the_heartbeat_before_its_ttl_runs_out(
    redis_client: Any, redis_prefix: str
) -> None:
    limiter = TenantLimiter(redis_client, key_prefix=redis_prefix, lease_ttl_s=0.6)
    lease = await limiter.acquire("acme", LARGE, 10)  # held past its TTL below
    key = f"{redis_prefix}:{{acme}}:inflight"
    await asyncio.sleep(0.25)  # past a third of the TTL: the heartbeat renews
    await limiter.heartbeat()
    await asyncio.sleep(0.5)  # past the first expiry, within the renewed one
    expiries = [score for _, score in await redis_client.zrange(key, 0, -1, withscores=True)]
    now_ms = time.time() * 1000
    assert expiries and min(expiries) > now_ms, "a held slot expired while its request ran"
    await lease.release()
