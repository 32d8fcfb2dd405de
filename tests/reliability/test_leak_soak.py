"""Soak for leaks: sustained mixed load on one gateway process; its memory, descriptors and
threads stay flat.

The load mixes the ways a request ends: served, streamed, a 400, a 401, a 404. After a
warm-up (caches, connection pools and lazy imports fill up), the gateway's VmRSS, open file
descriptors (sockets included) and threads are sampled from /proc after each round; growth
from the first sample to the last must stay within a tolerance that a leak of one object,
socket or task per request would exceed by far.

Streams the client drops mid-way have their own test: each must leave no upstream
connection behind. (Before commit 4ccf16a replaced httpx on the engine path, 600 dropped
streams left ~60 decode connections checked out of the pool in CLOSE_WAIT for good.)

Stand-in workers: the gateway's own resources are what is measured, not SGLang's.
``ISOGATE_LEAK_SOAK_ROUNDS`` lengthens the run (``scripts/soak leaks``).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.reliability.sockets import accepted_sockets, upstream_sockets
from tests.reliability.stack import (
    MODEL,
    STANDIN_POOL_TOKENS,
    StandInStack,
    chat_body,
    process_status,
    standin_stack,
)
from tests.standin_worker import Behaviour

ROUNDS = int(os.environ.get("ISOGATE_LEAK_SOAK_ROUNDS", "5"))
REQUESTS_PER_ROUND = 400
CLIENTS = 8
# A leak of one object per request would grow far beyond these over ROUNDS * REQUESTS_PER_ROUND
# requests.
RSS_TOLERANCE_KB = 12 * 1024
FD_TOLERANCE = 8
THREAD_TOLERANCE = 4
KINDS = ("served", "stream", "bad_request", "bad_key", "unknown_model")
WEIGHTS = (55, 20, 10, 10, 5)
DROPPED_STREAMS = 600
# The most upstream connections in use at once: per client thread, the request it awaits and
# the one before (the gateway finishes with its connections after answering), each with
# prefill's, decode's and, for a drop seen before the end, their aborts'.
POOL_AT_MOST = CLIENTS * 2 * 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    behaviour = Behaviour(text_chunks=("Hi", " there"), pool_tokens=STANDIN_POOL_TOKENS)
    with standin_stack(
        tmp_path_factory.mktemp("leak-soak"),
        behaviour=behaviour,
        env={
            "ISOGATE_LOG_LEVEL": "warning",
            # Stand-ins share this busy process with 8 client threads: polls can be slow.
            "ISOGATE_CAPACITY_STALE_AFTER_S": "15",
            # Every client here is one address: a longer soak sends it more bad keys a minute
            # than the per-address throttle allows (its 429s have their own tests), and a bad
            # key must end in the 401 this soak checks for leaks. The bound: every request of
            # the soak, its warm-up round included.
            "ISOGATE_UNAUTHENTICATED_PER_ADDRESS_PER_MINUTE": str(
                (ROUNDS + 1) * REQUESTS_PER_ROUND
            ),
        },
        # The workers never close an idle connection during the test: one the gateway did not
        # give back stays open, to be counted, rather than being closed for it by the worker.
        worker_keep_alive_s=3600,
    ) as running:
        yield running


def _one(client: httpx.Client, kind: str) -> str:
    if kind == "served":
        return str(client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code)
    if kind in ("stream", "dropped_stream"):
        with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(max_tokens=2, stream=True)
        ) as response:
            for line in response.iter_lines():
                if kind == "dropped_stream" and line.startswith("data: "):
                    break  # the client walks away mid-stream
            return f"{response.status_code}"
    if kind == "bad_request":
        return str(
            client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code
        )
    if kind == "bad_key":
        return str(
            client.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={"Authorization": "Bearer sk-iso-nope"},
            ).status_code
        )
    return str(
        client.post("/v1/chat/completions", json=chat_body(model="no-such-model")).status_code
    )


def _round(
    stack: StandInStack,
    key: str,
    rng: random.Random,
    requests: int,
    kinds_weights: tuple[tuple[str, ...], tuple[int, ...]] = (KINDS, WEIGHTS),
) -> Counter[str]:
    kinds = rng.choices(kinds_weights[0], weights=kinds_weights[1], k=requests)
    statuses: Counter[str] = Counter()

    def work(part: list[str]) -> Counter[str]:
        seen: Counter[str] = Counter()
        # A fresh connection per worker thread per round, like clients that come and go.
        with stack.client(key, timeout_s=30) as client:
            for kind in part:
                seen[f"{kind}:{_one(client, kind)}"] += 1
        return seen

    with ThreadPoolExecutor(CLIENTS) as pool:
        for seen in pool.map(work, [kinds[i::CLIENTS] for i in range(CLIENTS)]):
            statuses.update(seen)
    return statuses


def _settled_status(stack: StandInStack, pid: int) -> dict[str, int]:
    """The gateway's footprint once the round's client connections are all closed on its side
    (their sockets are then no longer among its descriptors)."""
    port = urlsplit(stack.gateway.url).port
    assert port is not None
    deadline = time.monotonic() + 30
    while accepted_sockets(pid, port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not accepted_sockets(pid, port), accepted_sockets(pid, port)
    return process_status(pid)


def test_sustained_mixed_load_leaves_memory_descriptors_and_threads_flat(
    stack: StandInStack, tmp_path: Path
) -> None:
    key = stack.key("soak-tenant")
    pid = stack.gateway.process.pid  # type: ignore[union-attr]  # started by the fixture
    rng = random.Random(7)
    _round(stack, key, rng, REQUESTS_PER_ROUND)  # warm-up
    samples = [_settled_status(stack, pid)]
    totals: Counter[str] = Counter()
    started = time.monotonic()
    for _ in range(ROUNDS):
        totals.update(_round(stack, key, rng, REQUESTS_PER_ROUND))
        samples.append(_settled_status(stack, pid))
    seconds = time.monotonic() - started
    report = {
        "requests": sum(totals.values()),
        "seconds": round(seconds, 1),
        "by_kind_status": dict(totals),
        "samples": samples,
    }
    print("LEAK-SOAK", report)
    expected = {
        "served": "200",
        "stream": "200",
        "dropped_stream": "200",
        "bad_request": "400",
        "bad_key": "401",
        "unknown_model": "404",
    }
    # Availability is the fault tests' subject; here a rare 503 (a capacity poll of a stand-in
    # starved by the client threads on this loaded machine) is tolerated, anything else is not.
    busy = sum(v for k, v in totals.items() if k.endswith(":503"))
    unexpected = {
        k: v for k, v in totals.items() if k.split(":")[1] not in (expected[k.split(":")[0]], "503")
    }
    assert not unexpected, unexpected
    assert busy <= sum(totals.values()) // 100, totals
    first, last = samples[0], samples[-1]
    assert last["VmRSS"] - first["VmRSS"] <= RSS_TOLERANCE_KB, samples
    assert last["fds"] - first["fds"] <= FD_TOLERANCE, samples
    assert last["Threads"] - first["Threads"] <= THREAD_TOLERANCE, samples
    # Not growing round over round either (a slow leak hiding under the tolerance at the end).
    rss = [s["VmRSS"] for s in samples]
    assert not all(later > earlier + 512 for earlier, later in pairwise(rss)), rss


def test_streams_dropped_by_the_client_leave_no_upstream_connection_behind(
    stack: StandInStack,
) -> None:
    key = stack.key("dropping-tenant")
    pid = stack.gateway.process.pid  # type: ignore[union-attr]  # started by the fixture
    _round(stack, key, random.Random(11), DROPPED_STREAMS, ((("dropped_stream",), (1,))))
    # What the gateway may hold afterwards: the idle pool, as large as the most connections
    # ever in use at once. A dropped stream's connection is closed or pooled once the drop is
    # noticed; one never given back stays open (the workers keep idle connections for the
    # whole test), so the count is awaited until it is down to the pool's at most.
    upstream_ports = {stack.prefill.port, stack.decode.port}
    deadline = time.monotonic() + 30
    while (
        sum((held := upstream_sockets(pid, upstream_ports)).values()) > POOL_AT_MOST
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    print("DROPPED-STREAMS", {"streams": DROPPED_STREAMS, "upstream_sockets": dict(held)})
    assert sum(held.values()) <= POOL_AT_MOST, held
    with stack.client(key) as client:  # and the pool still serves
        for _ in range(20):
            assert (
                client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200
            )
