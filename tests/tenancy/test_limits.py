"""Per-tenant RPM, TPM and concurrency limits, in memory and in real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from gateway.errors import APIError
from gateway.limits import LimitLease, TenantLimiter
from gateway.policies import TenantLimits

from .conftest import REDIS_URL

pytestmark = pytest.mark.anyio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["memory", "redis"])
def new_limiter(
    request: pytest.FixtureRequest, redis_client, redis_prefix: str
) -> Callable[[], TenantLimiter]:
    """Makes limiters that share state the way gateway replicas do (Redis), or the one (memory)."""
    if request.param == "memory":
        limiter = TenantLimiter(None)
        return lambda: limiter
    return lambda: TenantLimiter(redis_client, key_prefix=redis_prefix)


async def refusal(
    limiter: TenantLimiter, tenant: str, limits: TenantLimits, tokens: int
) -> APIError:
    with pytest.raises(APIError) as caught:
        await limiter.acquire(tenant, limits, tokens)
    return caught.value


async def test_requests_per_minute_refuses_the_request_over_the_limit(new_limiter) -> None:
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


async def test_limits_are_per_tenant(new_limiter) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=10_000, max_concurrent=100)
    for _ in range(2):
        await limiter.acquire("acme", limits, 1)
    await refusal(limiter, "acme", limits, 1)
    await limiter.acquire("beta", limits, 1)  # another tenant is untouched


async def test_tokens_are_reserved_at_admission_and_settled_to_the_real_count(new_limiter) -> None:
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


async def test_settling_over_the_reservation_takes_the_overshoot(new_limiter) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=1000, tokens_per_minute=1000, max_concurrent=100)
    lease = await limiter.acquire("acme", limits, 100)
    await lease.settle(700)
    await refusal(limiter, "acme", limits, 400)  # 1000 - 700 = 300 left


async def test_a_request_larger_than_the_tpm_limit_is_refused_with_the_reason(new_limiter) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=10)
    error = await refusal(limiter, "acme", limits, 1001)
    assert error.status == 429 and "Request too large" in error.message
    assert error.headers["Retry-After"] == "60"


async def test_concurrency_slot_is_released_on_every_path(new_limiter) -> None:
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


async def test_a_refused_request_takes_nothing_from_any_limit(new_limiter) -> None:
    limiter = new_limiter()
    limits = TenantLimits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=10)
    await limiter.acquire("acme", limits, 90)
    for _ in range(5):
        await refusal(limiter, "acme", limits, 50)  # over TPM: must not spend RPM
    await limiter.acquire("acme", limits, 5)
    await limiter.acquire("acme", limits, 5)


async def test_leaked_slot_of_a_dead_replica_expires(new_limiter) -> None:
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
    redis_client, redis_prefix: str
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
    assert all(isinstance(r, LimitLease) or r.status == 429 for r in results)

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
    assert 10 <= admitted <= most_admitted(1000, 100, time.monotonic() - started)


async def test_two_gateway_processes_sharing_redis_hold_the_limits_together(
    redis_prefix: str,
) -> None:
    """Each process is a separate interpreter with its own Redis connection, like two replicas."""
    script = textwrap.dedent(
        """
        import asyncio, json, sys, time
        import redis.asyncio as redis_asyncio
        from gateway.errors import APIError
        from gateway.limits import TenantLimiter
        from gateway.policies import TenantLimits

        async def main(url, prefix, start_at):
            client = redis_asyncio.from_url(url)
            await client.ping()
            await asyncio.sleep(max(0.0, start_at - time.time()))  # both start together
            limiter = TenantLimiter(client, key_prefix=prefix)
            rpm = TenantLimits(requests_per_minute=25, tokens_per_minute=1_000_000, max_concurrent=1000)
            tpm = TenantLimits(requests_per_minute=10_000, tokens_per_minute=2000, max_concurrent=1000)
            counts = {"rpm": 0, "tpm": 0}
            began = time.time()
            for _ in range(40):
                for name, limits, tokens in (("rpm", rpm, 1), ("tpm", tpm, 100)):
                    try:
                        await limiter.acquire(name + "-tenant", limits, tokens)
                        counts[name] += 1
                    except APIError:
                        pass
                await asyncio.sleep(0.002)
            await client.aclose()
            counts["began"], counts["ended"] = began, time.time()
            print(json.dumps(counts))

        asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
        """
    )
    start_at = str(time.time() + 5)  # both interpreters are up by then
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, REDIS_URL, redis_prefix, start_at],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        outputs.append(json.loads(out))
    elapsed_s = max(o["ended"] for o in outputs) - min(o["began"] for o in outputs)
    # Each process alone would admit 25 and 20: together they admit the tenant's limit,
    # plus what refills while they run.
    assert 25 <= sum(o["rpm"] for o in outputs) <= most_admitted(25, 1, elapsed_s)
    assert 20 <= sum(o["tpm"] for o in outputs) <= most_admitted(2000, 100, elapsed_s)
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


async def test_a_redis_that_never_answers_does_not_hang_admission() -> None:
    import socket

    import redis.asyncio as redis_asyncio

    silent = socket.socket()  # accepts connections (backlog) and never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    client = redis_asyncio.from_url(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    limiter = TenantLimiter(client, key_prefix="isogate-test-silent", redis_timeout_s=0.3)
    limits = TenantLimits(requests_per_minute=100, tokens_per_minute=10_000, max_concurrent=100)
    try:
        started = time.monotonic()
        lease = await limiter.acquire("acme", limits, 1)
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        for _ in range(20):  # Redis is left alone for a while: no timeout paid per request
            await limiter.acquire("acme", limits, 1)
        assert time.monotonic() - started < 0.2
        await lease.release()
    finally:
        await client.aclose()
        silent.close()
