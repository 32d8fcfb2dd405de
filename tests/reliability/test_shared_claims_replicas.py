"""Several gateway processes sharing Redis admit as one gateway: gate 1, tenant concurrency and
tokens hold across them, and a process killed while holding claims frees them within a bound.

Two deployments, each a real ``isogate serve`` in front of stand-in workers: two replicas
(two servers on two ports), and one server with ``--workers 2`` (two processes on one port;
which one accepts a connection is the kernel's choice, so each round sends several).

Every round races requests while the stand-in decode holds each one it gets (a closed gate),
until each request is either held there (admitted) or answered (refused): what is asserted is
how many were admitted together, never a duration.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.conftest import REDIS_URL
from tests.harness import PoolSpec, write_policies
from tests.reliability.services import RedisServer
from tests.reliability.stack import range_port
from tests.standin_worker import Behaviour, StandInWorker

pytestmark = pytest.mark.redis

MODEL = "tiny-llama"
# The decode pool holds one request of MAX_TOKENS (plus its prompt and the margin) and not
# two, whatever use the stand-in reports (under 100 tokens).
POOL_TOKENS = 1000
MAX_TOKENS = 500
HEARTBEAT_S = 1.0  # claims expire after three of these unless renewed
ROUNDS = 12
ATTEMPTS = 6  # concurrent requests per round, spread over the processes


@dataclass
class Deployment:
    urls: list[str]
    gateways: list[GatewayProcess]
    decode: StandInWorker
    gate: threading.Event
    prefix: str
    admin_key: str

    def key(self, tenant_id: str) -> str:
        with httpx.Client(
            base_url=self.urls[0], headers={"Authorization": f"Bearer {self.admin_key}"}
        ) as admin:
            if admin.get(f"/admin/tenants/{tenant_id}").status_code == 404:
                admin.post("/admin/tenants", json={"id": tenant_id}).raise_for_status()
            created = admin.post(f"/admin/tenants/{tenant_id}/keys", json={})
            created.raise_for_status()
            key: str = created.json()["key"]
            return key


@contextlib.contextmanager
def deployment(
    work_dir: Path,
    shape: str,
    *,
    tenants: dict[str, Any] | None = None,
    pool: int = POOL_TOKENS,
    redis_url: str = REDIS_URL,
) -> Iterator[Deployment]:
    gate = threading.Event()
    prefix = "isogate-test-" + secrets.token_hex(6)
    admin_key = "admin-" + secrets.token_hex(16)
    env = {
        "ISOGATE_REDIS_URL": redis_url,
        "ISOGATE_REDIS_KEY_PREFIX": prefix,
        "ISOGATE_CLAIM_HEARTBEAT_S": str(HEARTBEAT_S),
        # A request that finds no room in its own process is refused at once, not queued: a
        # round ends when every request is held or answered.
        "ISOGATE_QUEUE_MAX_WAIT_S": "0.05",
    }
    with contextlib.ExitStack() as stack:
        stack.callback(_clear, prefix)
        prefill = stack.enter_context(
            StandInWorker("prefill", Behaviour(pool_tokens=8192), port=range_port())
        )
        decode = stack.enter_context(
            StandInWorker("decode", Behaviour(pool_tokens=pool, gate=gate), port=range_port())
        )
        stack.callback(gate.set)  # nothing left held at the stand-in on the way out
        policies = write_policies(
            work_dir / "policies",
            model_name=MODEL,
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, range_port()),), (decode.url,))],
            max_context_tokens=8192,
            tenants=tenants,
        )
        processes = {"replicas": [1, 1], "workers": [2], "one": [1]}[shape]
        gateways = []
        for workers in processes:
            gateway = GatewayProcess(
                policies_dir=policies,
                work_dir=work_dir,
                env=env,
                port=range_port(),
                admin_key=admin_key,
                workers=workers,
            )
            stack.callback(gateway.stop)
            gateways.append(gateway.start(timeout_s=60))
        # --workers 2: both processes answer on the one port; every URL is sent to alike.
        urls = [gateway.url for gateway in gateways] * (2 // len(gateways))
        yield Deployment(urls, gateways, decode, gate, prefix, admin_key)


def _clear(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def chat(max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
    }


def race(
    stack: Deployment, keys: list[str], attempts: int = ATTEMPTS, max_tokens: int = MAX_TOKENS
) -> tuple[int, list[int]]:
    """One round: ``attempts`` requests at once, spread over the processes and ``keys``, while
    decode holds what it gets; returns how many decode held together once every request was
    held or answered, and the statuses of all once the gate opens."""
    stack.gate.clear()
    stack.decode.most_in_flight = 0
    with ThreadPoolExecutor(attempts) as pool:
        futures: list[Future[int]] = [
            pool.submit(_post, stack.urls[i % len(stack.urls)], keys[i % len(keys)], max_tokens)
            for i in range(attempts)
        ]
        deadline = time.monotonic() + 30
        while stack.decode.in_flight + sum(f.done() for f in futures) < attempts:
            assert time.monotonic() < deadline, "requests neither held nor answered"
            time.sleep(0.01)
        together = stack.decode.most_in_flight
        stack.gate.set()
        statuses = [future.result() for future in futures]
    return together, statuses


def _post(url: str, key: str, max_tokens: int) -> int:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        return c.post("/v1/chat/completions", json=chat(max_tokens)).status_code


SHAPES = ["replicas", "workers"]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_pool_that_holds_one_request_never_runs_two_sent_through_different_processes(
    tmp_path: Path, shape: str
) -> None:
    with deployment(tmp_path, shape) as stack:
        keys = [stack.key("acme"), stack.key("globex")]
        admitted_rounds = 0
        for round_number in range(ROUNDS):
            together, statuses = race(stack, keys)
            assert together <= 1, f"round {round_number}: {together} admitted together"
            assert set(statuses) <= {200, 503, 429}, statuses
            admitted_rounds += statuses.count(200) >= 1
        assert admitted_rounds == ROUNDS  # one of each round was admitted, not none
        # Every process configured its own logging: each one's startup is in the log.
        for gateway in stack.gateways:
            started = gateway.log_path.read_text().count("Application startup complete")
            assert started == gateway.workers, gateway.log_tail()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_tenants_concurrency_limit_holds_across_processes(tmp_path: Path, shape: str) -> None:
    limits = {"requests_per_minute": 100000, "tokens_per_minute": 100000000, "max_concurrent": 1}
    with deployment(tmp_path, shape, tenants={"acme": {"limits": limits}}, pool=8192) as stack:
        key = stack.key("acme")
        for round_number in range(ROUNDS):
            together, statuses = race(stack, [key], max_tokens=4)
            assert together <= 1, f"round {round_number}: {together} in flight for one tenant"
            assert statuses.count(200) >= 1 and set(statuses) <= {200, 429}, statuses


@pytest.mark.parametrize("shape", SHAPES)
def test_a_tenants_token_limit_holds_across_processes(tmp_path: Path, shape: str) -> None:
    # Room in the minute for one request's reservation (prompt + max_tokens), not two.
    limits = {"requests_per_minute": 100000, "tokens_per_minute": 700, "max_concurrent": 100}
    with deployment(tmp_path, shape, tenants={"acme": {"limits": limits}}, pool=8192) as stack:
        together, statuses = race(stack, [stack.key("acme")])
        assert together <= 1, f"{together} admitted within one minute's tokens"
        assert statuses.count(200) == 1 and set(statuses) <= {200, 429}, statuses


def _claim_holders(prefix: str, decode_url: str) -> list[int]:
    """The process ids holding claims on the decode worker (every claim id names its own)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        ids = client.hkeys(f"{prefix}:claims:{decode_url}:ids")
    finally:
        client.close()
    return [int(claim_id.decode().split("-", 1)[0]) for claim_id in ids]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_process_killed_while_holding_claims_frees_them_within_the_bound(
    tmp_path: Path, shape: str
) -> None:
    with deployment(tmp_path, shape) as stack:
        key = stack.key("acme")
        stack.gate.clear()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_post, stack.urls[0], key, MAX_TOKENS)
            deadline = time.monotonic() + 30
            while stack.decode.in_flight < 1:
                assert time.monotonic() < deadline and not held.done(), "never admitted"
                time.sleep(0.01)
            (holder,) = _claim_holders(stack.prefix, stack.decode.url)
            os.kill(holder, signal.SIGKILL)
            stack.gate.set()  # the stand-in lets the dead process's request go
            with contextlib.suppress(httpx.HTTPError):
                held.result()
        # Whatever process answers now: the dead one's claim keeps the pool until it expires.
        survivor = stack.urls[-1]
        assert _post(survivor, key, MAX_TOKENS) == 503
        bound_s = 3 * HEARTBEAT_S
        deadline = time.monotonic() + bound_s + 10  # the bound, and room for a busy host
        while _post(survivor, key, MAX_TOKENS) != 200:
            assert time.monotonic() < deadline, "the killed process's claims were never freed"
            time.sleep(0.1)


def test_while_redis_does_not_answer_admission_fails_closed_then_resumes(tmp_path: Path) -> None:
    own = RedisServer(range_port(), tmp_path / "redis").start()
    try:
        with deployment(tmp_path, "one", redis_url=own.url) as stack:
            key = stack.key("acme")
            stack.gate.set()
            assert _post(stack.urls[0], key, 4) == 200
            own.stop()
            stopped = time.monotonic()
            sent = len(stack.decode.requests)
            admitted = 0
            with httpx.Client(
                base_url=stack.urls[0], headers={"Authorization": f"Bearer {key}"}, timeout=60
            ) as client:
                # The process's lease (recorded before Redis stopped) may still admit, never
                # once its entry could have expired: 3 heartbeats after Redis last answered.
                while True:
                    posted = time.monotonic()
                    refused = client.post("/v1/chat/completions", json=chat(4))
                    if refused.status_code != 200:
                        break
                    assert posted < stopped + 3 * HEARTBEAT_S, "admitted past the lease's TTL"
                    admitted += 1
                    time.sleep(0.1)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "claims_unreachable"
            assert int(refused.headers["retry-after"]) >= 1
            # Nothing reached decode but what the lease admitted.
            assert len(stack.decode.requests) == sent + admitted
            own.start()
            deadline = time.monotonic() + 30
            while _post(stack.urls[0], key, 4) != 200:
                assert time.monotonic() < deadline, "admission never resumed with Redis back"
                time.sleep(0.2)
    finally:
        own.stop()
