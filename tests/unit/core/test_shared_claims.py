"""Gate 1 across processes: the leases, claims within them, their growth in Lua, their
renewal and shrinking, against the real Redis.

Each ``SharedClaims`` here stands for one gateway process (its own owner id); every test
uses its own key prefix. A lease holds one spare block (a sixteenth of the pool) beyond what
its requests use until the heartbeat after it was last admitted into.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.common.errors import APIError
from gateway.common.redis_pipeline import RedisPipeline
from gateway.config.policies import (
    DecodeWorker,
    ModelPolicy,
    PrefillWorker,
    Share,
    load_policies,
)
from gateway.core.admission import ClaimLedger
from gateway.core.pair_queues import PairQueues, QueueSettings
from gateway.core.routing import Candidates
from gateway.core.shared_claims import ClaimsUnreachable, SharedClaims
from gateway.observability.metrics import Metrics
from gateway.service.components import connect_redis
from gateway.workers.capacity import WorkerCapacity
from gateway.workers.pairs import WorkerPair
from tests.conftest import REDIS_URL
from tests.harness import PoolSpec, write_policies

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pair(pool: int, *, used: int = 0, decode_pool: int | None = None, port: int = 1) -> WorkerPair:
    def state(url: str, role: Any, size: int) -> WorkerCapacity:
        return WorkerCapacity(url, role, time.time(), size, None, None, 1, used, None)

    prefill, decode = (
        PrefillWorker(url=f"http://p:{port}", bootstrap_port=2),
        DecodeWorker(url=f"http://d:{port}"),
    )
    return WorkerPair(
        "shared",
        prefill,
        decode,
        state(prefill.url, "prefill", pool),
        state(decode.url, "decode", decode_pool if decode_pool is not None else pool),
    )


@pytest.fixture
def redis(redis_client: Any) -> Any:
    return redis_client


@pytest.fixture
def prefix(redis_prefix: str) -> str:
    return redis_prefix


def process(
    redis: Any, prefix: str, heartbeat_s: float = 1.0, commands: RedisPipeline | None = None
) -> SharedClaims:
    return SharedClaims(redis, prefix, heartbeat_s=heartbeat_s, commands=commands)


BLOCK = 1000 // 16  # the spare block a lease on a pool of 1000 takes with a top-up


async def test_of_two_processes_racing_for_a_pool_that_holds_one_only_one_is_admitted(
    redis: Any, prefix: str
) -> None:
    first, second = process(redis, prefix), process(redis, prefix)
    target = pair(1000)
    for _ in range(50):
        ids = await asyncio.gather(first.claim(target, 600), second.claim(target, 600))
        admitted = [(owner, i) for owner, i in zip((first, second), ids, strict=True) if i]
        assert len(admitted) == 1, ids
        owner, claim_id = admitted[0]
        assert claim_id is not None
        owner.release(claim_id)
        await owner.drain()


async def test_a_claim_takes_both_pools_or_neither(redis: Any, prefix: str) -> None:
    claims = process(redis, prefix)
    assert await claims.claim(pair(1000, decode_pool=500), 600) is None
    for url in ("http://p:1", "http://d:1"):
        assert await redis.hlen(claims.keys(url)[0]) == 0
    assert await claims.claim(pair(1000), 600) is not None


async def test_a_running_request_counts_once_not_as_claim_plus_engine_use(
    redis: Any, prefix: str
) -> None:
    first, second = process(redis, prefix), process(redis, prefix)
    assert await first.claim(pair(1000), 400) is not None  # its lease: 400 and a block spare
    # The engine now reports that request's 400 tokens in use: the larger of the two, the
    # lease's 400 + BLOCK, is taken, so 600 - BLOCK are free (their sum would leave less).
    assert await second.claim(pair(1000, used=400), 600 - BLOCK) is not None
    assert await second.claim(pair(1000, used=400), 1) is None
    # Use the gateway did not claim (another client of the engine) is counted too.
    third = process(redis, f"{prefix}-other")
    assert await third.claim(pair(1000, used=900), 200) is None


async def test_a_small_release_stays_in_the_lease_until_the_next_heartbeat(
    redis: Any, prefix: str
) -> None:
    first, second = process(redis, prefix), process(redis, prefix)
    claim_id = await first.claim(pair(1000), 50)
    held = await first.claim(pair(1000), 400)  # the lease: 450 and a block spare
    assert claim_id is not None and held is not None
    assert await second.claim(pair(1000), 500) is None
    first.release(claim_id)  # 50 more unused: within two blocks, kept for the next requests
    await asyncio.sleep(0.1)  # time enough for a shrink, had one been started
    assert await second.claim(pair(1000), 500) is None
    await first.renew()
    assert await second.claim(pair(1000), 500) is not None


async def test_a_large_release_frees_its_room_for_every_process_without_waiting_for_a_heartbeat(
    redis: Any, prefix: str
) -> None:
    first, second = process(redis, prefix), process(redis, prefix)
    claim_id = await first.claim(pair(1000), 600)
    assert claim_id is not None
    assert await second.claim(pair(1000), 600) is None
    first.release(claim_id)  # no heartbeat runs in this test
    deadline = time.monotonic() + 1  # well within the TTL, after which the lease would expire
    while await second.claim(pair(1000), 600) is None:
        assert time.monotonic() < deadline, "the released room stayed in the first's lease"
        await asyncio.sleep(0.01)


async def test_a_process_that_stops_renewing_frees_its_claims_within_the_ttl(
    redis: Any, prefix: str
) -> None:
    dead = process(redis, prefix, heartbeat_s=0.1)  # never renews: as if killed
    alive = process(redis, prefix)
    assert await dead.claim(pair(1000), 600) is not None
    assert await alive.claim(pair(1000), 600) is None
    deadline = time.monotonic() + 10 * dead.ttl_ms / 1000
    while await alive.claim(pair(1000), 600) is None:
        assert time.monotonic() < deadline, "the dead process's claim never expired"
        await asyncio.sleep(0.05)


async def test_a_process_that_renews_keeps_its_claims_past_the_ttl(redis: Any, prefix: str) -> None:
    holder = process(redis, prefix, heartbeat_s=0.1)
    other = process(redis, prefix)
    assert await holder.claim(pair(1000), 600) is not None
    for _ in range(8):  # well past three heartbeats
        await holder.renew()
        await asyncio.sleep(holder.heartbeat_s)
    await holder.renew()
    assert await other.claim(pair(1000), 600) is None


async def test_a_renewal_records_again_a_claim_that_expired_while_its_request_still_runs(
    redis: Any, prefix: str
) -> None:
    holder = process(redis, prefix, heartbeat_s=0.1)
    other = process(redis, prefix)
    assert await holder.claim(pair(1000), 600) is not None
    await redis.delete(*holder.keys("http://p:1"), *holder.keys("http://d:1"))  # as if expired
    await holder.renew()
    assert await other.claim(pair(1000), 600) is None


async def test_an_unreachable_redis_fails_admission_closed_with_retry_after() -> None:
    import redis.asyncio as redis_asyncio

    client = redis_asyncio.from_url("redis://127.0.0.1:1/0")  # nothing listens there
    try:
        claims = SharedClaims(client, "unreachable", heartbeat_s=1.0)
        with pytest.raises(ClaimsUnreachable):
            await claims.claim(pair(1000), 10)
        ledger = ClaimLedger(shared=claims)
        with pytest.raises(APIError) as refused:
            await ledger.take(pair(1000), 10)
        assert refused.value.status == 503
        assert refused.value.code == "claims_unreachable"
        assert "Retry-After" in refused.value.headers
        assert ledger.claimed == {}
    finally:
        await client.aclose()


async def test_the_ledger_takes_and_releases_the_shared_claim_with_its_own(
    redis: Any, prefix: str
) -> None:
    ledger = ClaimLedger(shared=process(redis, prefix))
    other = process(redis, prefix)
    claim = await ledger.take(pair(1000), 600)
    assert claim is not None and ledger.claimed == {"http://p:1": 600, "http://d:1": 600}
    assert await other.claim(pair(1000), 600) is None
    assert await ledger.take(pair(1000), 600) is None  # this process's own claims: no room
    with claim:
        pass
    assert ledger.claimed == {}
    assert ledger.shared is not None
    await ledger.shared.renew()  # the heartbeat returns what the release left in the lease
    assert await other.claim(pair(1000), 600) is not None


def one_pool_model(tmp_path: Path) -> ModelPolicy:
    """Model ``m``, served by one pool of one pair (``pair`` of its workers)."""
    directory = write_policies(
        tmp_path,
        model_name="m",
        tokenizer_dir=tmp_path,
        pools=[PoolSpec("shared", (("http://p:1", 2),), ("http://d:1",))],
    )
    return load_policies(directory).models["m"]


@pytest.mark.parametrize(("kv_shared", "granted"), [(False, 500), (True, 1000)])
def test_with_shared_claims_each_replicas_queue_may_grant_the_whole_pool(
    tmp_path: Path, kv_shared: bool, granted: int
) -> None:
    # Split among two replicas, a request for more than half the pool would never be granted;
    # shared claims bound the pool across them instead. The request slots stay split.
    model = one_pool_model(tmp_path)
    queues = PairQueues(QueueSettings(8, 10.0, 10, replicas=2, kv_shared=kv_shared), Metrics())
    assert queues.queue(model, pair(1000)).kv_capacity == granted
    assert queues.caps_of(model, pair(1000))[0] == 4


async def test_a_request_larger_than_a_replicas_part_of_the_pool_is_refused_at_once(
    tmp_path: Path,
) -> None:
    # Without shared claims each of two replicas may hold half the pool: a request for more
    # would wait its whole turn (10 s) and be told the pair is busy, however idle it is.
    model = one_pool_model(tmp_path)
    queues = PairQueues(QueueSettings(8, 10.0, 10, replicas=2), Metrics())
    started = time.monotonic()
    with pytest.raises(APIError) as refused:
        await queues.wait_turn(model, pair(1000), Share("acme"), 1, 501, 1.0)
    assert (refused.value.status, refused.value.code) == (400, "request_too_large")
    assert "at most 500" in refused.value.message and time.monotonic() - started < 5
    granted = queues.take_free(model, pair(1000), Share("acme"), 1, 500, 1.0)
    assert granted is not None  # half the pool is granted
    granted.release()


async def test_a_dead_process_with_thousands_of_claims_frees_them_all(
    redis: Any, prefix: str
) -> None:
    alive = process(redis, prefix)
    # Claims a dead process left, expired: more than one purge batch, and more than Lua's
    # unpack takes at once (8000).
    ids_key, expiry_key = alive.keys("http://d:1")
    left = {f"dead-{i}": 1 for i in range(9000)}
    await redis.hset(ids_key, mapping=left)
    await redis.zadd(expiry_key, dict.fromkeys(left, 1))
    assert await alive.claim(pair(1000), 1000) is not None
    assert await redis.hlen(ids_key) == 1


async def test_a_burst_of_admissions_past_the_connection_pool_waits_rather_than_failing_closed(
    prefix: str,
) -> None:
    client = connect_redis(REDIS_URL)  # the gateway's own client
    try:
        claims = process(client, prefix)
        ids = await asyncio.gather(*(claims.claim(pair(10**9), 1) for _ in range(300)))
        assert all(ids)
    finally:
        await client.aclose()


async def test_routing_prefers_the_pair_the_other_processes_hold_less_of(
    redis: Any, prefix: str
) -> None:
    ledger = ClaimLedger(shared=process(redis, prefix))
    other = process(redis, prefix)
    first, second = pair(1000, port=1), pair(1000, port=2)
    candidates = Candidates([first, second], 8192)
    # Another process holds half of the first, and a block spare.
    assert await other.claim(first, 500) is not None
    ledger.free_now(first.decode_state)  # routing has compared these workers: now watched
    ledger.free_now(second.decode_state)
    assert ledger.shared is not None
    await ledger.shared.renew()  # one heartbeat
    assert ledger.free_now(first.decode_state) == 500 - BLOCK
    assert candidates.choose_for_all(ledger, (10,), 10, 0) is second


class CountedPipeline(RedisPipeline):
    """The auto-pipeline, counting the round trips it makes."""

    def __init__(self, redis: Any) -> None:
        super().__init__(redis)
        self.round_trips = 0

    async def _round_trip(self, batch: list[Any]) -> list[Any]:
        self.round_trips += 1
        return await super()._round_trip(batch)


def lease_of(claims: SharedClaims) -> str:
    return f"{claims._owner}:lease"


async def test_claims_within_the_lease_make_no_redis_round_trip(redis: Any, prefix: str) -> None:
    commands = CountedPipeline(redis)
    claims = process(redis, prefix, commands=commands)
    first = await claims.claim(pair(1000), 400)  # grows the lease: 400 and a block spare
    assert first is not None and commands.round_trips == 1
    for _ in range(20):  # each fits the block left: taken and given back locally
        claim_id = await claims.claim(pair(1000), BLOCK)
        assert claim_id is not None
        claims.release(claim_id)
    assert commands.round_trips == 1
    assert await claims.claim(pair(1000), BLOCK + 1) is not None  # past the lease: Redis
    assert commands.round_trips == 2


async def test_an_idle_processs_lease_is_returned_at_its_heartbeat(redis: Any, prefix: str) -> None:
    idle, other = process(redis, prefix), process(redis, prefix)
    claim_id = await idle.claim(pair(1000), 600)
    assert claim_id is not None
    idle.release(claim_id)
    # Admitted into since its last heartbeat: the next one keeps a block spare, no more.
    await idle.renew()
    assert await redis.hget(idle.keys("http://d:1")[0], lease_of(idle)) == str(BLOCK).encode()
    assert await other.claim(pair(1000), 1000) is None
    # Idle for a whole heartbeat: the next one returns all of it.
    await idle.renew()
    assert await redis.hlen(idle.keys("http://d:1")[0]) == 0
    assert await other.claim(pair(1000), 1000) is not None


async def test_a_busy_processs_lease_keeps_at_most_one_block_spare(redis: Any, prefix: str) -> None:
    busy = process(redis, prefix)
    ids = [await busy.claim(pair(1000), 100) for _ in range(8)]
    for claim_id in ids[2:]:  # 200 still in use, the lease far above it
        assert claim_id is not None
        busy.release(claim_id)
    await busy.renew()
    for url in ("http://p:1", "http://d:1"):
        assert await redis.hvals(busy.keys(url)[0]) == [str(200 + BLOCK).encode()]
    other = process(redis, prefix)
    assert await other.claim(pair(1000), 800 - BLOCK) is not None


async def test_a_process_whose_renewals_fail_past_the_ttl_stops_admitting_locally(
    prefix: str,
) -> None:
    import redis.asyncio as redis_asyncio
    from redis.exceptions import ConnectionError as Unreachable

    client = redis_asyncio.from_url(REDIS_URL)  # its own: this test cuts it off Redis
    try:
        claims = process(client, prefix)
        leased_at = time.monotonic()  # before the top-up was sent: its entry outlives the TTL
        assert await claims.claim(pair(1000), 100) is not None
        # Cut off: its connections closed and new ones made where nothing listens.
        client.connection_pool.connection_kwargs["port"] = 1
        await client.connection_pool.disconnect()
        client.connection_pool.reset()
        # Within the lease: still admitted, locally, while the heartbeat fails.
        with pytest.raises(Unreachable):
            await claims.renew()
        claim_id = await claims.claim(pair(1000), 10)
        assert claim_id is not None
        claims.release(claim_id)
        # Before its entry in Redis can have expired, the process goes to Redis: fails closed.
        while True:
            with pytest.raises(Unreachable):
                await claims.renew()
            try:
                claim_id = await claims.claim(pair(1000), 10)
            except ClaimsUnreachable:
                break
            assert claim_id is not None
            claims.release(claim_id)
            assert time.monotonic() < leased_at + claims.ttl_ms / 1000, "admitted past the TTL"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_concurrent_claims_of_one_process_never_take_more_than_its_lease(
    redis: Any, prefix: str
) -> None:
    claims = process(redis, prefix)
    ids = await asyncio.gather(*(claims.claim(pair(1000), 300) for _ in range(10)))
    assert sum(1 for claim_id in ids if claim_id) == 3
    for url in ("http://p:1", "http://d:1"):
        assert claims.in_use[url] == 900 <= claims.leased[url] <= 1000
        assert await redis.hvals(claims.keys(url)[0]) == [str(claims.leased[url]).encode()]
