"""``RedisPipeline`` against the real Redis: concurrent requests' commands share round trips,
and every caller gets its own reply or its own error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.exceptions

from gateway.common.redis_pipeline import RedisPipeline

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


class CountingRedis:
    """The real client, counting the round trips made through it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.round_trips = 0

    def pipeline(self, *, transaction: bool) -> Any:
        self.round_trips += 1
        return self.client.pipeline(transaction=transaction)

    async def execute_command(self, *command: Any) -> Any:
        self.round_trips += 1
        return await self.client.execute_command(*command)

    async def script_load(self, script: str) -> Any:
        return await self.client.script_load(script)


async def test_commands_queued_in_one_turn_share_one_round_trip(
    redis_client: Any, redis_prefix: str
) -> None:
    counting = CountingRedis(redis_client)
    commands = RedisPipeline(counting)
    replies = await asyncio.gather(
        *(commands.execute_command("INCRBY", f"{redis_prefix}:n", k) for k in range(1, 17))
    )
    assert counting.round_trips == 1
    # Each caller's reply is its own command's: INCRBY in order gives the running sums.
    assert replies == [k * (k + 1) // 2 for k in range(1, 17)]


async def test_commands_sent_during_a_round_trip_go_together_in_the_next(
    redis_client: Any, redis_prefix: str
) -> None:
    counting = CountingRedis(redis_client)
    commands = RedisPipeline(counting)
    first = commands.submit("INCR", f"{redis_prefix}:n")
    await asyncio.sleep(0)  # the first round trip is on its way
    later = [commands.submit("INCR", f"{redis_prefix}:n") for _ in range(8)]
    assert await first == 1
    assert sorted(await asyncio.gather(*later)) == list(range(2, 10))
    assert counting.round_trips == 2


async def test_each_caller_gets_its_own_error(redis_client: Any, redis_prefix: str) -> None:
    await redis_client.set(f"{redis_prefix}:text", "not a number")
    commands = RedisPipeline(redis_client)
    good = commands.submit("INCR", f"{redis_prefix}:n")
    bad = commands.submit("INCR", f"{redis_prefix}:text")
    also_good = commands.submit("INCR", f"{redis_prefix}:n")
    assert await good == 1
    with pytest.raises(redis.exceptions.ResponseError):
        await bad
    assert await also_good == 2


async def test_a_lone_command_that_fails_fails_alone(redis_client: Any, redis_prefix: str) -> None:
    await redis_client.set(f"{redis_prefix}:text", "not a number")
    commands = RedisPipeline(redis_client)
    with pytest.raises(redis.exceptions.ResponseError):
        await commands.execute_command("INCR", f"{redis_prefix}:text")
    assert await commands.execute_command("INCR", f"{redis_prefix}:n") == 1


async def test_an_unreachable_redis_fails_every_command_of_the_round_trip() -> None:
    import redis.asyncio as redis_asyncio

    unreachable = redis_asyncio.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    commands = RedisPipeline(unreachable, timeout_s=2.0)
    try:
        outcomes = await asyncio.gather(
            *(commands.submit("INCR", "n") for _ in range(3)), return_exceptions=True
        )
    finally:
        await unreachable.aclose()
    assert all(isinstance(o, redis.exceptions.ConnectionError) for o in outcomes), outcomes


async def test_a_caller_that_stops_waiting_leaves_the_others_their_replies(
    redis_client: Any, redis_prefix: str
) -> None:
    commands = RedisPipeline(redis_client)
    gone = commands.submit("INCR", f"{redis_prefix}:n")
    kept = commands.submit("INCR", f"{redis_prefix}:n")
    gone.cancel()
    assert await kept == 2  # the cancelled caller's command still went out before it
    await commands.aclose()


async def test_a_script_redis_lost_is_loaded_again(redis_client: Any, redis_prefix: str) -> None:
    script = redis_client.register_script("return redis.call('INCR', KEYS[1])")
    commands = RedisPipeline(redis_client)
    key = f"{redis_prefix}:n"
    assert await commands.run_script(script, [key], []) == 1  # never loaded: loaded now
    await redis_client.script_flush()
    assert await commands.run_script(script, [key], []) == 2


async def test_a_scripts_first_use_keeps_its_place_in_the_order(
    redis_client: Any, redis_prefix: str
) -> None:
    # A script no process has run yet: its text is new to Redis.
    text = f"-- {redis_prefix}\nreturn redis.call('APPEND', KEYS[1], ARGV[1])"
    script = redis_client.register_script(text)
    commands = RedisPipeline(redis_client)
    key = f"{redis_prefix}:log"
    first = commands.submit_script(script, [key], ["a"])
    after = commands.submit("APPEND", key, "b")
    await asyncio.gather(first, after)
    assert await redis_client.get(key) == b"ab"


async def test_commands_reach_redis_in_the_order_they_were_submitted(
    redis_client: Any, redis_prefix: str
) -> None:
    script = redis_client.register_script("return redis.call('APPEND', KEYS[1], ARGV[1])")
    commands = RedisPipeline(redis_client)
    key = f"{redis_prefix}:log"
    await commands.run_script(script, [key], ["0"])  # loaded
    submitted = [
        commands.submit_script(script, [key], ["a"]),
        commands.submit("APPEND", key, "b"),
        commands.submit_script(script, [key], ["c"]),
    ]
    await asyncio.sleep(0)  # that round trip is on its way; these go in the next
    submitted.append(commands.submit("APPEND", key, "d"))
    await asyncio.gather(*submitted)
    assert await redis_client.get(key) == b"0abcd"
