"""Per-tenant RPM, TPM and concurrency limits, in memory and in real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import redis.asyncio as redis_asyncio

import gateway.tenancy.limits
from gateway.common.errors import APIError
from gateway.config.policies import TenantLimits
from gateway.tenancy.limit_shares import spare_of
from gateway.tenancy.limits import (
    _REDIS_RETRY_S,
    DEFAULT_SPARE_FRACTION,
    LimitLease,
    TenantLimiter,
    limiter_scripts,
)
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.anyio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def refusal(
    limiter: TenantLimiter, tenant: str, limits: TenantLimits, tokens: int
) -> APIError:
    with pytest.raises(APIError) as caught:
        await limiter.acquire(tenant, limits, tokens)
    return caught.value


async def test_requests_per_minute_refuses_the_request_over_the_limit(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=5, tokens_per_minute=10_000, max_concurrent=100)
    for _ in range(5):
        await limiter.acquire("acme", limits, 10)
    error = await refusal(limiter, "acme", limits, 10)
    assert (error.status, error.type, error.code) == (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
    )
    assert "requests per minute" in error.message
    # One request refills every 12 s at 5 RPM.
    assert 1 <= int(error.headers["Retry-After"]) <= 12


async def test_limits_are_per_tenant(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=10_000, max_concurrent=100)
    for _ in range(2):
        await limiter.acquire("acme", limits, 1)
    await refusal(limiter, "acme", limits, 1)
    await limiter.acquire("beta", limits, 1)  # another tenant is untouched


async def test_tokens_are_reserved_at_admission_and_settled_to_the_real_count(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=1000, max_concurrent=100)
    first = await limiter.acquire("acme", limits, 600)  # prompt + max_tokens
    error = await refusal(limiter, "acme", limits, 600)
    assert "tokens per minute" in error.message
    # 200 tokens missing at 1000 TPM: 12 s.
    assert 11 <= int(error.headers["Retry-After"]) <= 13
    await first.settle(100)  # it used 100 of its 600
    await limiter.acquire("acme", limits, 600)
    await refusal(limiter, "acme", limits, 600)


async def test_settling_over_the_reservation_takes_the_overshoot(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=1000, max_concurrent=100)
    lease = await limiter.acquire("acme", limits, 100)
    await lease.settle(700)
    await refusal(limiter, "acme", limits, 400)  # 1000 - 700 = 300 left


async def test_a_request_larger_than_the_tpm_limit_is_refused_with_the_reason(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=10)
    error = await refusal(limiter, "acme", limits, 1001)
    assert error.status == 429 and "Request too large" in error.message
    assert error.headers["Retry-After"] == "60"


async def test_concurrency_slot_is_released_on_every_path(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=100_000, max_concurrent=2)
    first = await limiter.acquire("acme", limits, 1)
    second = await limiter.acquire("acme", limits, 1)
    error = await refusal(limiter, "acme", limits, 1)
    assert "concurrent" in error.message and error.headers["Retry-After"] == "1"

    # Normal end.
    await first.release()
    await first.release()  # idempotent: does not free a second slot
    third = await limiter.acquire("acme", limits, 1)
    await refusal(limiter, "acme", limits, 1)

    # Failure inside the request.
    with pytest.raises(RuntimeError):
        async with second:
            raise RuntimeError("upstream died")

    # Cancellation.
    async def cancelled_request(lease: LimitLease) -> None:
        async with lease:
            await asyncio.sleep(3600)

    task = asyncio.create_task(cancelled_request(third))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    leases = [await limiter.acquire("acme", limits, 1) for _ in range(2)]
    await refusal(limiter, "acme", limits, 1)
    for lease in leases:
        await lease.release()


async def test_a_refused_request_takes_nothing_from_any_limit(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=10)
    await limiter.acquire("acme", limits, 90)
    for _ in range(5):
        await refusal(limiter, "acme", limits, 50)  # over TPM: must not spend RPM
    await limiter.acquire("acme", limits, 5)
    await limiter.acquire("acme", limits, 5)


async def test_leaked_slot_of_a_dead_replica_expires(
    new_limiter: Callable[[], TenantLimiter],
) -> None:
    base = new_limiter()
    limiter = TenantLimiter(base._redis, key_prefix=base._prefix, lease_ttl_s=1.5)
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=100_000, max_concurrent=1)
    await limiter.acquire("acme", limits, 1)  # never released
    await refusal(limiter, "acme", limits, 1)
    await asyncio.sleep(1.6)
    await limiter.acquire("acme", limits, 1)


def most_admitted(limit_per_minute: int, cost: int, elapsed_s: float) -> int:
    """What a per-minute limit may admit over ``elapsed_s``: the full bucket plus its refill."""
    return int((limit_per_minute + elapsed_s * limit_per_minute / 60) // cost)


async def test_two_limiters_sharing_redis_hold_rpm_and_tpm_together(
    redis_client: redis_asyncio.Redis, redis_prefix: str
) -> None:
    replica_a = TenantLimiter(redis_client, key_prefix=redis_prefix)
    replica_b = TenantLimiter(redis_client, key_prefix=redis_prefix)
    rpm = TenantLimits(requests_per_minute=20, tokens_per_minute=1_000_000, max_concurrent=1000)
    started = time.monotonic()
    results = await asyncio.gather(
        *(
            replica.acquire("rpm-tenant", rpm, 1)
            for replica in (replica_a, replica_b)
            for _ in range(30)
        ),
        return_exceptions=True,
    )
    admitted = sum(isinstance(r, LimitLease) for r in results)
    # Alone, each replica would have admitted 20: together they admit the tenant's 20.
    assert 20 <= admitted <= most_admitted(20, 1, time.monotonic() - started)
    assert all(
        isinstance(r, LimitLease) or (isinstance(r, APIError) and r.status == 429) for r in results
    )

    tpm = TenantLimits(requests_per_minute=1000, tokens_per_minute=1000, max_concurrent=1000)
    admitted = 0
    started = time.monotonic()
    for i in range(40):
        replica = replica_a if i % 2 else replica_b
        try:
            await replica.acquire("tpm-tenant", tpm, 100)
            admitted += 1
        except APIError:
            pass
    # Short of the limit by what the other replica holds spare, at most (limit_shares).
    least = (1000 - spare_of(tpm, DEFAULT_SPARE_FRACTION).tokens) // 100
    assert least <= admitted <= most_admitted(1000, 100, time.monotonic() - started)


async def test_two_gateway_processes_sharing_redis_hold_the_limits_together(
    redis_prefix: str,
) -> None:
    """Each process is a separate interpreter with its own Redis connection, like two replicas."""
    script = textwrap.dedent(
        """
        import asyncio, json, sys, time
        import redis.asyncio as redis_asyncio
        from gateway.common.errors import APIError
        from gateway.tenancy.limits import TenantLimiter
        from gateway.config.policies import TenantLimits

        async def main(url, prefix):
            client = redis_asyncio.from_url(url)
            await client.ping()
            limiter = TenantLimiter(client, key_prefix=prefix)
            print("ready", flush=True)
            sys.stdin.readline()  # both start together, whenever both are up
            rpm = TenantLimits(
                requests_per_minute=25, tokens_per_minute=1_000_000, max_concurrent=1000
            )
            tpm = TenantLimits(
                requests_per_minute=10_000, tokens_per_minute=2000, max_concurrent=1000
            )
            counts = {"rpm": 0, "tpm": 0}
            began = time.time()
            for _ in range(40):
                for name, limits, tokens in (("rpm", rpm, 1), ("tpm", tpm, 100)):
                    try:
                        await limiter.acquire(name + "-tenant", limits, tokens)
                        counts[name] += 1
                    except APIError:
                        pass
                await asyncio.sleep(0.01)  # the two interleave, even on a busy host
            await client.aclose()
            counts["began"], counts["ended"] = began, time.time()
            print(json.dumps(counts))

        asyncio.run(main(sys.argv[1], sys.argv[2]))
        """
    )
    # Blocking on purpose: the test has nothing else to run while the two processes work.
    processes = [
        subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-c", script, REDIS_URL, redis_prefix],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for process in processes:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n", process.communicate(timeout=60)[1]
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        outputs.append(json.loads(out))
    elapsed_s = max(o["ended"] for o in outputs) - min(o["began"] for o in outputs)
    # Each process alone would admit 25 and 20: together they admit the tenant's limit,
    # plus what refills while they run.
    assert 25 <= sum(o["rpm"] for o in outputs) <= most_admitted(25, 1, elapsed_s)
    tpm = TenantLimits(requests_per_minute=10_000, tokens_per_minute=2000, max_concurrent=1000)
    least = (2000 - spare_of(tpm, DEFAULT_SPARE_FRACTION).tokens) // 100  # the other's spare
    assert least <= sum(o["tpm"] for o in outputs) <= most_admitted(2000, 100, elapsed_s)
    assert all(o["rpm"] > 0 for o in outputs)  # both processes really took part


async def test_unreachable_redis_falls_back_to_limits_in_memory() -> None:
    import redis.asyncio as redis_asyncio

    client = redis_asyncio.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    limiter = TenantLimiter(client, key_prefix="isogate-test-unreachable")
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=1000, max_concurrent=10)
    lease = await limiter.acquire("acme", limits, 1)
    await limiter.acquire("acme", limits, 1)
    await refusal(limiter, "acme", limits, 1)
    await lease.settle(1)
    await lease.release()
    await client.aclose()


class SilentRedis:
    """A server that accepts connections and never says a word; counts the connections, i.e.
    the limiter's tries (a call cut off by its timeout leaves its connection unusable)."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self._listener.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for sock in self.accepted:
            sock.close()


async def test_a_redis_that_never_answers_does_not_hang_admission() -> None:
    silent = SilentRedis()
    client = redis_asyncio.from_url(f"redis://127.0.0.1:{silent.port}/0")
    limiter = TenantLimiter(client, key_prefix="isogate-test-silent", redis_timeout_s=0.3)
    limits = TenantLimits(requests_per_minute=100, tokens_per_minute=10_000, max_concurrent=100)
    try:
        started = time.monotonic()
        # A hang would never end: the deadline is far past the limiter's own timeout.
        lease = await asyncio.wait_for(limiter.acquire("acme", limits, 1), timeout=30)
        for _ in range(20):  # Redis is left alone for a while: no timeout paid per request
            await asyncio.wait_for(limiter.acquire("acme", limits, 1), timeout=30)
        elapsed_s = time.monotonic() - started
        # One try, and one more per retry interval that passed however slow the host; a try
        # per request would be 21.
        assert 1 <= len(silent.accepted) <= 1 + elapsed_s / _REDIS_RETRY_S + 1, (
            f"{len(silent.accepted)} tries of Redis in {elapsed_s:.1f} s"
        )
        await lease.release()
    finally:
        await client.aclose()
        silent.close()


# ---- the Redis path and the in-memory path are one algorithm ---------------------------------
#
# The refill is written in Lua (Redis) and in Python (memory). These tests hold the two equal:
# both paths get the same calls at the same instants of one clock, and every decision (admitted,
# or refused with which limit) must match. The Redis scripts are production's, with Redis's
# clock swapped for one the test sets; the in-memory path reads the same clock.


class SharedClock:
    """One clock for both paths: ``tenancy.limits`` reads it as ``time.monotonic()``, the Redis
    scripts from a key holding the very float the in-memory path computes, so both see one
    ``now`` to the last bit."""

    def __init__(self, redis_client: redis_asyncio.Redis, key: str) -> None:
        self.seconds = 1000.0
        self._redis = redis_client
        self.key = key

    def monotonic(self) -> float:
        return self.seconds

    async def advance(self, ms: float) -> None:
        self.seconds += ms / 1000
        await self._redis.set(self.key, repr(self.seconds * 1000))

    def now_lua(self) -> str:
        return f"local now = tonumber(redis.call('GET', '{self.key}'))\n"


@dataclass(frozen=True)
class Decision:
    admitted: bool
    message: str = ""  # the refusal's, which names the limit
    retry_after_s: int = 0

    @property
    def limit(self) -> str:
        if self.admitted:
            return ""
        for limit in ("concurrent", "requests per minute", "tokens per minute"):
            if limit in self.message:
                return limit
        raise AssertionError(f"a refusal naming no limit: {self.message}")


async def decide(
    limiter: TenantLimiter, tenant: str, limits: TenantLimits, tokens: int
) -> tuple[Decision, LimitLease | None]:
    try:
        return Decision(True), await limiter.acquire(tenant, limits, tokens)
    except APIError as error:
        return Decision(False, error.message, int(error.headers["Retry-After"])), None


class TwoPaths:
    """The same tenant limiter twice: in Redis (with the shared clock) and in memory."""

    def __init__(self, redis_client: redis_asyncio.Redis, prefix: str, clock: SharedClock):
        lease_ttl_s = 20.0
        # With no spare, a process's shares are the request-by-request algorithm of memory;
        # what a spare changes has tests of its own.
        self.redis = TenantLimiter(
            redis_client, key_prefix=prefix, lease_ttl_s=lease_ttl_s, spare_fraction=0
        )
        acquire, settle = limiter_scripts(now=clock.now_lua())
        self.redis._acquire_script = redis_client.register_script(acquire)
        self.redis._settle_script = redis_client.register_script(settle)
        self.memory = TenantLimiter(None, lease_ttl_s=lease_ttl_s)
        self.leases: list[tuple[LimitLease, LimitLease]] = []
        self.decisions: list[Decision] = []

    async def acquire(self, tenant: str, limits: TenantLimits, tokens: int) -> None:
        on_redis, redis_lease = await decide(self.redis, tenant, limits, tokens)
        in_memory, memory_lease = await decide(self.memory, tenant, limits, tokens)
        step = f"call {len(self.decisions)}: acquire({tenant!r}, {limits}, {tokens})"
        assert (on_redis.admitted, on_redis.message) == (in_memory.admitted, in_memory.message), (
            step
        )
        # Redis rounds a wait up to a whole millisecond first, so its hint may be 1 s later.
        assert 0 <= on_redis.retry_after_s - in_memory.retry_after_s <= 1, step
        self.decisions.append(in_memory)
        if redis_lease is not None and memory_lease is not None:
            self.leases.append((redis_lease, memory_lease))

    async def settle(self, index: int, actual_tokens: int) -> None:
        for lease in self.leases[index]:
            await lease.settle(actual_tokens)
        # A settle is sent, not awaited; the clock is set on a connection of its own, which
        # must not overtake it.
        await self.redis.drain()

    async def release(self, index: int) -> None:
        for lease in self.leases[index]:
            await lease.release()


@pytest.fixture
async def two_paths(
    redis_client: redis_asyncio.Redis, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[TwoPaths, SharedClock]:
    clock = SharedClock(redis_client, f"{redis_prefix}:clock")
    await clock.advance(0)
    monkeypatch.setattr(
        gateway.tenancy.limits, "time", types.SimpleNamespace(monotonic=clock.monotonic)
    )
    return TwoPaths(redis_client, redis_prefix, clock), clock


def limits_refusing(decisions: list[Decision]) -> set[str]:
    return {d.limit for d in decisions if not d.admitted}


EVERY_LIMIT = {"concurrent", "requests per minute", "tokens per minute"}


async def test_redis_and_memory_decide_alike_through_refill_settle_and_expiry(
    two_paths: tuple[TwoPaths, SharedClock],
) -> None:
    paths, clock = two_paths
    limits = TenantLimits(requests_per_minute=4, tokens_per_minute=1000, max_concurrent=2)
    for lease in range(3):  # leases 0-2, each released at once
        await paths.acquire("acme", limits, 100)
        await paths.release(lease)
    await paths.acquire("acme", limits, 100)  # lease 3, held; the bucket has no request left
    await paths.acquire("acme", limits, 100)  # RPM
    await clock.advance(7_500)  # half a request refilled
    await paths.acquire("acme", limits, 100)  # RPM
    await clock.advance(7_500)  # one request refilled
    await paths.acquire("acme", limits, 100)  # lease 4, held
    await paths.acquire("acme", limits, 100)  # two leases held: concurrency
    await paths.release(3)
    await clock.advance(15_000)
    await paths.acquire("acme", limits, 600)  # lease 5, held: 400 tokens left
    await paths.release(4)
    await clock.advance(30_000)  # 500 tokens refilled: 900
    await paths.acquire("acme", limits, 950)  # TPM
    await paths.settle(5, 0)  # lease 5 used none of its 600: the bucket is full again
    await paths.acquire("acme", limits, 950)  # lease 6, held with lease 5 (never released)
    await clock.advance(25_000)  # past the lease TTL: leases 5 and 6 no longer count
    await paths.acquire("acme", limits, 10)  # lease 7
    # A long idle fills the bucket to the limit; an overshoot settled then is taken from the
    # full bucket, not from refill beyond the limit.
    await clock.advance(600_000)
    await paths.settle(6, 1900)  # 950 over its reservation: 50 tokens left
    await paths.acquire("acme", limits, 200)  # TPM
    # A policy reload: the new limits apply to the bucket as it stands.
    raised = TenantLimits(requests_per_minute=60, tokens_per_minute=6000, max_concurrent=10)
    await clock.advance(30_000)  # 3000 tokens refilled at the new rate: 3050
    await paths.acquire("acme", raised, 2000)  # lease 8
    await paths.acquire("acme", raised, 2000)  # TPM
    rpm, tpm, slots = "requests per minute", "tokens per minute", "concurrent"
    assert [d.limit for d in paths.decisions] == [
        *["", "", "", ""],
        *[rpm, rpm, "", slots, ""],
        *[tpm, "", "", tpm, "", tpm],
    ]


@pytest.mark.parametrize("seed", range(3))
async def test_redis_and_memory_decide_alike_on_random_traffic(
    two_paths: tuple[TwoPaths, SharedClock], seed: int
) -> None:
    paths, clock = two_paths
    rng = random.Random(seed)
    # One tenant bound by each limit, so random traffic meets all three.
    tenants = {
        "few-requests": TenantLimits(
            requests_per_minute=3, tokens_per_minute=100_000, max_concurrent=100
        ),
        "few-tokens": TenantLimits(
            requests_per_minute=1000, tokens_per_minute=800, max_concurrent=100
        ),
        "few-slots": TenantLimits(
            requests_per_minute=1000, tokens_per_minute=100_000, max_concurrent=2
        ),
    }
    for _ in range(300):
        step = rng.random()
        if step < 0.5:
            tenant = rng.choice(sorted(tenants))
            await paths.acquire(tenant, tenants[tenant], rng.randint(0, 500))
        elif step < 0.65 and paths.leases:
            await paths.settle(rng.randrange(len(paths.leases)), rng.randint(0, 800))
        elif step < 0.8 and paths.leases:
            await paths.release(rng.randrange(len(paths.leases)))
        else:
            await clock.advance(rng.uniform(0, 8_000))
    # The traffic met every limit and was admitted often: the comparison covered each branch.
    assert limits_refusing(paths.decisions) == EVERY_LIMIT
    assert len(paths.leases) > 20
