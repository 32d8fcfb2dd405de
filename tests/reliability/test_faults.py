"""Faults the gateway must ride out: a hanging worker, capacity data gone stale, Redis and
PostgreSQL restarted.

For each: the client gets a clear OpenAI error within the configured timeout (never a hang),
the other tenants' requests keep being served, and no audit event is lost: every request
sent has exactly one event, and every response id that was served is among them.

Workers are stand-ins here (a real SGLang worker cannot hang on purpose, and these faults sit
between the gateway and its state, not in the engine); Redis and PostgreSQL are real servers
of the test's own, started, killed and restarted on ports of this suite's range. The engine
faults (workers killed mid-stream, mid-transfer) are in ``test_engine_faults``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from starlette.types import Receive, Scope, Send

from gateway.dev.harness import GatewayProcess
from tests.reliability.load import Answer, Load, by_tenant, send_chat
from tests.reliability.services import PostgresCluster, RedisServer
from tests.reliability.stack import (
    STANDIN_POOL_TOKENS,
    PoolWorkers,
    TwoPoolStack,
    chat_body,
    range_port,
    two_pool_policies,
    wait_until,
)
from tests.standin_worker import Behaviour, StandInWorker

UPSTREAM_TIMEOUT_S = 2.0
STALE_AFTER_S = 5.0  # the staleness test's window
# Other tests' window: the stand-ins share one busy Python process with the client threads, and on
# this loaded 2-core machine a capacity poll of a healthy stand-in can take seconds.
ROOMY_STALE_AFTER_S = 15.0
# How much later than the configured timeout an answer may come (process scheduling, polling).
SLACK_S = 2.0
VICTIM, BYSTANDERS = "victim", ("bystander-1", "bystander-2")


@dataclass
class CapacityFreezingWorker(StandInWorker):
    """A stand-in whose capacity and liveness endpoints can stop answering while ``/generate``
    still works: the gateway can no longer tell that it serves, so it is taken out."""

    frozen: bool = field(default=False)

    def app(self) -> Any:
        inner = super().app()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if (
                self.frozen
                and scope["type"] == "http"
                and scope["path"] in ("/server_info", "/v1/loads", "/v1/models", "/health")
            ):
                await asyncio.sleep(3600)
            await inner(scope, receive, send)

        return app


def _standin(
    role: str, behaviour: Behaviour | None = None, cls: type[StandInWorker] = StandInWorker
) -> StandInWorker:
    return cls(
        role,
        behaviour or Behaviour(text_chunks=("Hi",), pool_tokens=STANDIN_POOL_TOKENS),
        port=range_port(),
    )


@contextlib.contextmanager
def two_pools(
    work_dir: Path,
    *,
    victim_prefill: StandInWorker | None = None,
    victim_decode: StandInWorker | None = None,
    env: dict[str, str] | None = None,
    database_url: str | None = None,
    stale_after_s: float = ROOMY_STALE_AFTER_S,
) -> Iterator[TwoPoolStack]:
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(worker)
            for worker in (
                victim_prefill or _standin("prefill"),
                victim_decode or _standin("decode"),
                _standin("prefill"),
                _standin("decode"),
            )
        ]
        policies = two_pool_policies(
            work_dir,
            victim=VICTIM,
            victim_pool=PoolWorkers(workers[0].url, range_port(), workers[1].url),
            shared_pool=PoolWorkers(workers[2].url, range_port(), workers[3].url),
        )
        settings = {
            "ISOGATE_UPSTREAM_TIMEOUT_S": str(UPSTREAM_TIMEOUT_S),
            "ISOGATE_CAPACITY_STALE_AFTER_S": str(stale_after_s),
            "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.1",
            **({"ISOGATE_DATABASE_URL": database_url} if database_url else {}),
            **(env or {}),
        }
        gateway = stack.enter_context(
            GatewayProcess(
                policies_dir=policies, work_dir=work_dir, env=settings, port=range_port()
            )
        )
        running = TwoPoolStack(gateway, VICTIM, *workers)
        for tenant in (VICTIM, *BYSTANDERS):
            running.key(tenant)
        yield running


def _bystander_load(stack: TwoPoolStack, body: dict[str, Any] | None = None) -> Load:
    clients = {tenant: stack.client(tenant, timeout_s=30) for tenant in BYSTANDERS}
    return Load(send_chat(body or chat_body(max_tokens=1)), clients).start()


def _assert_every_request_audited(
    stack: TwoPoolStack, answers: list[Answer], tenants: tuple[str, ...]
) -> None:
    """One event per request, per tenant; every served response id among them.

    Waits for the batched writer."""
    for tenant in tenants:
        sent = by_tenant(answers, tenant)
        assert wait_until(
            lambda tenant=tenant, sent=sent: len(stack.audit_events(tenant)) >= len(sent),
            timeout_s=30,
        ), f"{tenant}: {len(stack.audit_events(tenant))} events for {len(sent)} requests"
        events = stack.audit_events(tenant)
        assert len(events) == len(sent), f"{tenant}: {len(events)} events for {len(sent)} requests"
        audited = {event["generation_id"] for event in events}
        served = {a.generation_id for a in sent if a.generation_id}
        assert served <= audited, (
            f"{tenant}: served but not audited: {sorted(served - audited)[:5]}"
        )
        assert len(audited) == len(events), f"{tenant}: duplicate audit events"


def _assert_all_served(answers: list[Answer]) -> None:
    failed = [a for a in answers if a.status != 200 or a.code is not None]
    assert answers and not failed, (
        f"{len(failed)} of {len(answers)} bystander requests failed: {failed[:3]}"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("hanging", ["decode", "prefill"])
def test_a_hanging_worker_costs_its_tenant_a_504_within_the_timeout_and_nobody_else_anything(
    tmp_path: Path, hanging: str, stream: bool
) -> None:
    hang = Behaviour(text_chunks=("Hi",), hang=True, pool_tokens=STANDIN_POOL_TOKENS)
    worker = _standin(hanging, hang)
    with two_pools(tmp_path, **{f"victim_{hanging}": worker}) as stack:
        load = _bystander_load(stack)
        victim_answers: list[Answer] = []
        with stack.client(VICTIM, timeout_s=60) as client:
            for _ in range(3):
                victim_answers.append(
                    send_chat(chat_body(max_tokens=1, stream=stream))(client, VICTIM)
                )
        answers = load.stop() + victim_answers
        for answer in victim_answers:
            assert answer.seconds < UPSTREAM_TIMEOUT_S + SLACK_S, answer
            assert answer.code == "upstream_timeout", answer
            # Before the first byte the status says it; after it (a prefill that never finishes
            # while decode streamed), the stream ends with the error event instead of [DONE].
            assert answer.status == 504 or answer.stream_error, answer
        _assert_all_served(by_tenant(answers, BYSTANDERS[0]) + by_tenant(answers, BYSTANDERS[1]))
        _assert_every_request_audited(stack, answers, (VICTIM, *BYSTANDERS))
        outcomes = {(e["outcome"], e["code"]) for e in stack.audit_events(VICTIM)}
        assert outcomes == {("upstream_error", "upstream_timeout")}, outcomes


def test_a_worker_that_answers_no_probe_is_taken_out_then_recovers_and_bystanders_never_notice(
    tmp_path: Path,
) -> None:
    decode = _standin("decode", cls=CapacityFreezingWorker)
    assert isinstance(decode, CapacityFreezingWorker)
    with two_pools(
        tmp_path,
        victim_decode=decode,
        stale_after_s=STALE_AFTER_S,
        env={"ISOGATE_WORKER_LIVENESS_TIMEOUT_S": "1"},
    ) as stack:
        load = _bystander_load(stack)
        victim_answers: list[Answer] = []
        send = send_chat(chat_body(max_tokens=1))
        with stack.client(VICTIM, timeout_s=60) as client:
            victim_answers.append(send(client, VICTIM))
            assert victim_answers[-1].status == 200, victim_answers[-1]
            decode.frozen = True
            # Its liveness probe times out: taken out, and refused quickly.
            assert wait_until(
                lambda: (
                    victim_answers.append(send(client, VICTIM)) or victim_answers[-1].status == 503
                ),
                timeout_s=STALE_AFTER_S + 4 * SLACK_S,
            )
            refused = victim_answers[-1]
            assert refused.code == "no_worker_available" and refused.seconds < SLACK_S, refused
            for _ in range(3):
                victim_answers.append(send(client, VICTIM))
                assert victim_answers[-1].status == 503 and victim_answers[-1].seconds < SLACK_S
            decode.frozen = False
            assert wait_until(
                lambda: (
                    victim_answers.append(send(client, VICTIM)) or victim_answers[-1].status == 200
                ),
                timeout_s=4 * SLACK_S,
            ), victim_answers[-1]
        answers = load.stop() + victim_answers
        _assert_all_served(by_tenant(answers, BYSTANDERS[0]) + by_tenant(answers, BYSTANDERS[1]))
        _assert_every_request_audited(stack, answers, (VICTIM, *BYSTANDERS))


def _assert_clear_and_timely(answers: list[Answer], bound_s: float) -> None:
    slow = [a for a in answers if a.seconds > bound_s]
    assert not slow, f"{len(slow)} answers slower than {bound_s}s: {slow[:3]}"
    server_errors = [a for a in answers if a.status >= 500 and a.status != 503]
    assert not server_errors, server_errors[:3]


def _answered_within(answers: list[Answer], start: float, end: float = math.inf) -> list[Answer]:
    """The answers to requests sent after ``start`` and complete before ``end``."""
    return [a for a in answers if a.started_at > start and a.ended_at < end]


# The gateway's default: its KV leases expire three of these after their last renewal.
CLAIM_HEARTBEAT_S = 1.0


def _limit_buckets(redis_server: RedisServer) -> set[str]:
    """The tenants whose limits the gateway keeps in this Redis (a bucket of theirs is there)."""
    with redis.Redis(port=redis_server.port, socket_timeout=2) as client:
        keys = client.keys("isogate:*:bucket")
    return {key.decode().split("{", 1)[1].split("}", 1)[0] for key in keys}


def test_redis_killed_and_restarted_under_load_fails_closed_then_serves_and_loses_no_audit_event(
    tmp_path: Path,
) -> None:
    """With Redis configured, every process's KV claims are leased from it (gate 1 across
    processes): while it is down, admission fails closed, clearly, once the lease the process
    held could have expired there, and never admits what the shared claims cannot vouch for;
    once it is back, every tenant is served again."""
    tenants = (VICTIM, *BYSTANDERS)
    with (
        RedisServer(range_port(), tmp_path / "redis") as redis_server,
        two_pools(tmp_path, env={"ISOGATE_REDIS_URL": redis_server.url}) as stack,
    ):
        clients = {tenant: stack.client(tenant, timeout_s=30) for tenant in tenants}
        load = Load(send_chat(chat_body(max_tokens=1)), clients).start()
        # Before the kill, the gateway keeps every tenant's limits in Redis (a bucket appears at a
        # tenant's first request) and has answered each tenant.
        assert wait_until(lambda: _limit_buckets(redis_server) == set(tenants), timeout_s=30), (
            f"limits kept in Redis before the kill for {_limit_buckets(redis_server)} only"
        )
        assert wait_until(lambda: all(by_tenant(load.answers, t) for t in tenants), timeout_s=30)
        killed_at = time.monotonic()
        redis_server.stop()
        # The KV room the process leased before the kill may still be admitted into, never once
        # its entry could have expired in Redis: three heartbeats after Redis last answered.
        lease_over_at = killed_at + 3 * CLAIM_HEARTBEAT_S
        # Answered while Redis is down: several requests of each tenant sent after that and
        # answered before the restart (every answer is judged below).
        assert wait_until(
            lambda: all(
                len(by_tenant(_answered_within(load.answers, lease_over_at), t)) >= 3
                for t in tenants
            ),
            timeout_s=30,
        ), "no request was answered while Redis was down: the gateway stalled on it"
        # The limits are spent from the process's shares, so the limiter learns of the outage
        # at its next heartbeat (or a share's top-up), and falls back to memory.
        assert wait_until(
            lambda: "limits: Redis unreachable" in stack.gateway.log_tail(1_000_000),
            timeout_s=10,
        ), "the limiter never noticed Redis was gone"
        restarted_at = time.monotonic()
        within_lease = _answered_within(load.answers, killed_at, lease_over_at)
        during = _answered_within(load.answers, lease_over_at, restarted_at)
        redis_server.start()  # empty: it keeps no data across a restart
        # After the restart the gateway goes back to Redis: the tenants' buckets are made anew.
        assert wait_until(lambda: _limit_buckets(redis_server) == set(tenants), timeout_s=30), (
            f"limits kept in Redis after the restart for {_limit_buckets(redis_server)} only"
        )
        back_at = time.monotonic()
        assert wait_until(
            lambda: all(
                len(by_tenant(_answered_within(load.answers, back_at), t)) >= 3 for t in tenants
            ),
            timeout_s=30,
        )
        answers = load.stop()
        # Limits fall back to memory, but a KV claim needs every process's claims: past the
        # lease, each request of the outage is refused with a 503 that says why, none admitted.
        refused = [(a.status, a.code) for a in during]
        assert during and set(refused) == {(503, "claims_unreachable")}, refused[:5]
        early = {(a.status, a.code) for a in within_lease}
        assert early <= {(200, None), (503, "claims_unreachable")}, early
        _assert_all_served(_answered_within(answers, 0.0, killed_at))
        _assert_all_served(_answered_within(answers, back_at))
        _assert_clear_and_timely(answers, UPSTREAM_TIMEOUT_S + SLACK_S)
        _assert_every_request_audited(stack, answers, tenants)


def test_postgres_restarted_under_load_spools_and_replays_every_audit_event(tmp_path: Path) -> None:
    with (
        PostgresCluster(range_port()) as postgres,
        # Key cache entries expire well within the outage, so every key is served from the
        # stale-if-error path while the database is away, not from a still-fresh entry.
        two_pools(
            tmp_path, database_url=postgres.url, env={"ISOGATE_AUTH_CACHE_TTL_S": "0.5"}
        ) as stack,
    ):
        tenants = (VICTIM, *BYSTANDERS)
        clients = {tenant: stack.client(tenant, timeout_s=30) for tenant in tenants}
        load = Load(send_chat(chat_body(max_tokens=1)), clients).start()
        # Before the stop, every tenant's events are in the database.
        assert wait_until(lambda: all(stack.audit_events(t) for t in tenants), timeout_s=30)
        stopped_at = time.monotonic()
        postgres.stop("immediate")
        # Served while the database is away, once the gateway has seen that it is: several
        # requests of each tenant sent after the stop and answered before the restart.
        assert wait_until(
            lambda: (
                "key store unreachable" in stack.gateway.log_tail(1_000_000)
                and all(
                    len(by_tenant(_answered_within(load.answers, stopped_at), t)) >= 3
                    for t in tenants
                )
            ),
            timeout_s=30,
        ), "no request completed while PostgreSQL was down: the request path waited on it"
        restarted_at = time.monotonic()
        during = _answered_within(load.answers, stopped_at, restarted_at)
        postgres.start()
        assert wait_until(
            lambda: all(
                len(by_tenant(_answered_within(load.answers, restarted_at), t)) >= 3
                for t in tenants
            ),
            timeout_s=30,
        )
        answers = load.stop()
        _assert_all_served(during)
        _assert_clear_and_timely(answers, UPSTREAM_TIMEOUT_S + SLACK_S)
        # Keys recently seen valid are served stale and audit events spool while the database
        # is away: the gateway noticed the store was down, and served every request anyway.
        _assert_all_served(answers)
        _assert_every_request_audited(stack, answers, tenants)
