"""Fair share of a saturated pair, through a real gateway process (gateway.core.fair_queue).

Stand-in workers, because the point is a pair held saturated for exactly as long as a test
needs: the decode stand-in's gate holds every generation until the test opens it. The pool's
``max_in_flight_per_pair`` is 1, so the order in which the decode stand-in receives requests
once the gate opens is the order in which the gateway's queue let them go. Nothing is timed:
the tests wait for states (the queue's length, the decode's requests), never for durations.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import Behaviour, StandInWorker
from tests.verification.stack import (
    MODEL,
    POOL_TOKENS,
    gateway_metric,
    range_port,
    sse_events,
    start_gateway,
    wait_until,
)

TENANTS = {
    "heavy": {"weight": 2},
    "light": {"weight": 1},
    "blocker": {},
    # One request at a time: a limits lease left behind by any path would refuse the next.
    "single": {"limits": {"max_concurrent": 1}},
}


@dataclass
class GatedStack:
    decode: StandInWorker
    gate: threading.Event
    gateways: list[GatewayProcess]  # replicas sharing one store, one policy and the workers
    keys: dict[str, str]
    prefill: StandInWorker | None = None

    @property
    def gateway(self) -> GatewayProcess:
        return self.gateways[0]

    def client(self, tenant: str, timeout: float = 60, replica: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateways[replica].url,
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
            timeout=timeout,
        )

    def metric(self, name: str, **labels: str) -> float:
        return sum(gateway_metric(gateway, name, **labels) for gateway in self.gateways)

    def served_tenants(self) -> list[str]:
        return [r["_headers"].get("x-isolation-tenant", "") for r in self.decode.requests]

    def claimed_tokens(self) -> int:
        total = 0
        for gateway in self.gateways:
            with gateway.admin() as admin:
                workers = admin.get("/admin/workers").json()["data"]
            total += sum(worker["claimed_tokens"] for worker in workers)
        return total


@contextlib.contextmanager
def gated_stack(
    work_dir: Path,
    max_wait_s: float,
    *,
    replicas: int = 1,
    pool_cap: int = 1,
    pool_contended_cap: int | None = None,
) -> Iterator[GatedStack]:
    gate = threading.Event()
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(
            StandInWorker("prefill", Behaviour(pool_tokens=POOL_TOKENS), port=range_port())
        )
        decode = stack.enter_context(
            StandInWorker(
                "decode", Behaviour(pool_tokens=POOL_TOKENS, gate=gate), port=range_port()
            )
        )
        policies = write_policies(
            work_dir / "policies",
            model_name=MODEL,
            tokenizer_dir=ensure_tiny_model(DEFAULT_MODEL_DIR),
            pools=[PoolSpec("shared", ((prefill.url, range_port()),), (decode.url,))],
            max_context_tokens=POOL_TOKENS,
            tenants=TENANTS,
        )
        # The pool's own cap (the policy override) sets the pair's in-flight cap.
        models = yaml.safe_load((policies / "models.yaml").read_text())
        models["models"][0]["pools"][0]["max_in_flight_per_pair"] = pool_cap
        if pool_contended_cap is not None:
            models["models"][0]["pools"][0]["max_in_flight_per_pair_contended"] = pool_contended_cap
        (policies / "models.yaml").write_text(yaml.safe_dump(models))
        env = {
            "ISOGATE_QUEUE_MAX_WAIT_S": str(max_wait_s),
            "ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR": "8",
            "ISOGATE_QUEUE_REPLICAS": str(replicas),
        }
        gateways = []
        for _ in range(replicas):
            # One work directory: one SQLite store, so a key made on one replica works on all.
            gateways.append(start_gateway(policies, work_dir, env))
            stack.callback(gateways[-1].stop)
        stack.callback(gate.set)  # nothing left hanging in the stand-in when the stack goes
        keys = {tenant: gateways[0].create_tenant(tenant)[1] for tenant in TENANTS}
        yield GatedStack(decode, gate, gateways, keys, prefill)


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedStack]:
    """A stack whose queued requests wait far longer than any test here runs."""
    with gated_stack(tmp_path_factory.mktemp("fair-patient"), max_wait_s=600) as stack:
        yield stack


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedStack]:
    with gated_stack(tmp_path_factory.mktemp("fair-impatient"), max_wait_s=0.2) as stack:
        yield stack


def _body(stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }


def _send(
    stack: GatedStack, tenant: str, results: list[Any], stream: bool = False, replica: int = 0
) -> None:
    with stack.client(tenant, replica=replica) as client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=_body(True)) as response:
                events = sse_events(response)
                results.append((response.status_code, events[-1] if events else None))
        else:
            response = client.post("/v1/chat/completions", json=_body())
            results.append((response.status_code, None))


def _in_threads(calls: list[Any]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    return threads


def _hold_the_pair(stack: GatedStack, results: list[Any]) -> list[threading.Thread]:
    """Close the gate and put a blocker's request on the pair's one slot of every replica."""
    stack.gate.clear()
    stack.decode.requests.clear()
    replicas = len(stack.gateways)
    threads = _in_threads(
        [lambda r=r: _send(stack, "blocker", results, replica=r) for r in range(replicas)]
    )
    assert wait_until(lambda: len(stack.decode.requests) == replicas, 30), "blockers stuck"
    return threads


def _queued(stack: GatedStack) -> float:
    return stack.metric("isogate_queue_length")


def test_weights_two_to_one_are_served_two_to_one_under_saturation(patient: GatedStack) -> None:
    results: list[Any] = []
    threads = _hold_the_pair(patient, results)
    # heavy (weight 2) sends whole answers, light (weight 1) streams: both kinds queue alike.
    threads += _in_threads(
        [lambda: _send(patient, "heavy", results) for _ in range(20)]
        + [lambda: _send(patient, "light", results, stream=True) for _ in range(20)]
    )
    assert wait_until(lambda: _queued(patient) == 40, 60), _queued(patient)
    patient.gate.set()
    for thread in threads:
        thread.join(60)
    assert [status for status, _ in results] == [200] * 41
    assert all(last == "[DONE]" for _, last in results if last is not None)
    served = patient.served_tenants()
    assert served[0] == "blocker"
    # While both waited (the first 30 after the blocker), heavy was served twice as often.
    shares = Counter(served[1:31])
    assert shares["heavy"] == pytest.approx(2 * shares["light"], rel=0.15), shares
    # First come first served would have sent every one of heavy's 20 first, or interleaved
    # them 1 : 1; the metrics count what each tenant was served.
    assert patient.metric("isogate_queue_served_total", tenant="heavy") >= 20
    assert patient.metric("isogate_queue_served_total", tenant="light") >= 20
    assert patient.claimed_tokens() == 0


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(patient: GatedStack) -> None:
    results: list[Any] = []
    threads = _hold_the_pair(patient, results)
    left: list[str] = []

    def leave(stream: bool) -> None:
        # The client gives up after a second: far less than the queue's wait (600 s).
        with patient.client("single", timeout=1) as client:
            try:
                if stream:
                    with client.stream("POST", "/v1/chat/completions", json=_body(True)) as r:
                        r.read()
                else:
                    client.post("/v1/chat/completions", json=_body())
            except httpx.TimeoutException:
                left.append("stream" if stream else "whole")

    abandoned_before = patient.metric("isogate_queue_refused_total", reason="abandoned")
    for thread in _in_threads([lambda: leave(False), lambda: leave(True)]):
        thread.join(30)
    assert sorted(left) == ["stream", "whole"]
    # Both left the queue on their client's disconnect, while the pair is still held.
    assert wait_until(
        lambda: (
            patient.metric("isogate_queue_refused_total", reason="abandoned") - abandoned_before
            == 2
        ),
        30,
    )
    assert _queued(patient) == 0
    assert not patient.gate.is_set()
    patient.gate.set()
    for thread in threads:
        thread.join(60)
    assert results == [(200, None)]
    assert "single" not in patient.served_tenants()  # never reached a worker
    # Nothing of theirs is held: "single" (one request at a time) is served at once.
    with patient.client("single") as client:
        assert client.post("/v1/chat/completions", json=_body()).status_code == 200
    assert patient.claimed_tokens() == 0


def test_a_wait_past_the_bound_is_429_over_share_or_503_pool_full(impatient: GatedStack) -> None:
    results: list[Any] = []
    threads = _hold_the_pair(impatient, results)
    with impatient.client("blocker") as client:
        over = client.post("/v1/chat/completions", json=_body())
    with impatient.client("single") as client:
        full = client.post("/v1/chat/completions", json=_body())
        with client.stream("POST", "/v1/chat/completions", json=_body(True)) as streamed:
            streamed.read()
            full_stream = streamed
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "tenant_over_share"
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert int(over.headers["Retry-After"]) >= 1
    for refused in (full, full_stream):
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "pool_saturated"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert int(refused.headers["Retry-After"]) >= 1
    assert impatient.served_tenants() == ["blocker"]
    impatient.gate.set()
    for thread in threads:
        thread.join(60)
    assert results == [(200, None)]
    # Every refused path gave back what it held: the one slot, the lease, the KV tokens.
    with impatient.client("single") as client:
        assert client.post("/v1/chat/completions", json=_body()).status_code == 200
    assert impatient.claimed_tokens() == 0
    assert _queued(impatient) == 0


def test_claims_are_released_when_the_worker_fails_after_the_queue(impatient: GatedStack) -> None:
    impatient.gate.set()
    impatient.decode.behaviour.status = 500
    try:
        with impatient.client("single") as client:
            failed = client.post("/v1/chat/completions", json=_body())
            with client.stream("POST", "/v1/chat/completions", json=_body(True)) as streamed:
                streamed.read()
    finally:
        impatient.decode.behaviour.status = 200
    assert failed.status_code >= 500 and streamed.status_code >= 500
    with impatient.client("single") as client:
        assert client.post("/v1/chat/completions", json=_body()).status_code == 200
        with client.stream("POST", "/v1/chat/completions", json=_body(True)) as streamed:
            assert sse_events(streamed)[-1] == "[DONE]"
    assert impatient.claimed_tokens() == 0


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedStack]:
    """Two replicas in front of one pair of cap 2: each holds ceil(2 / 2) = 1 of it."""
    with gated_stack(
        tmp_path_factory.mktemp("fair-replicas"), max_wait_s=600, replicas=2, pool_cap=2
    ) as stack:
        yield stack


def test_replicas_together_stay_within_the_cap_and_keep_the_shares(replicated: GatedStack) -> None:
    """Each replica holds its part of the cap and shares that part 2 : 1 among the tenants it
    sees (the documented bound, docs/operations.md): checked replica by replica, since how the
    two replicas' turns interleave at the decode depends on which of them runs first."""
    results: list[Any] = []
    threads = _hold_the_pair(replicated, results)
    replica_of: dict[str, int] = {}  # generation ID -> the replica that served it

    def send(tenant: str, replica: int) -> None:
        with replicated.client(tenant, replica=replica) as client:
            response = client.post("/v1/chat/completions", json=_body())
        replica_of[response.headers.get("x-generation-id", "")] = replica
        results.append((response.status_code, None))

    # A load balancer alternating between the replicas: each tenant's requests spread evenly.
    threads += _in_threads(
        [
            lambda r=r, tenant=tenant: send(tenant, r)
            for tenant in ("heavy", "light")
            for _ in range(9)
            for r in (0, 1)
        ]
    )
    assert wait_until(lambda: _queued(replicated) == 36, 60), _queued(replicated)
    # 38 requests in the gateways, the pair's cap is 2: the decode has seen exactly 2.
    assert replicated.served_tenants() == ["blocker", "blocker"]
    replicated.gate.set()
    for thread in threads:
        thread.join(60)
    assert [status for status, _ in results] == [200] * 38
    served = [
        (replica_of[r["rid"]], r["_headers"].get("x-isolation-tenant", ""))
        for r in replicated.decode.requests[2:]
    ]
    for replica in (0, 1):
        # 9 of each waited on this replica: while both still waited (its first 12 turns, as
        # heavy runs out after 13), heavy was served twice as often as light.
        turns = [tenant for served_by, tenant in served if served_by == replica]
        assert len(turns) == 18
        shares = Counter(turns[:12])
        assert shares["heavy"] == pytest.approx(2 * shares["light"], rel=0.15), (replica, turns)
    assert replicated.claimed_tokens() == 0


def test_a_tenant_within_its_share_starts_at_once_and_the_engine_is_told_the_order(
    tmp_path: Path,
) -> None:
    """Cap 3, contended cap 1: heavy alone gets 2 onto the pair (the first within its share of
    the contended cap, the second beyond it); light's request then starts at once, without
    waiting for either of heavy's to end, and heavy's next one waits. Each /generate body
    carries the SGLang priority of its place in that order, to prefill and decode alike."""
    with gated_stack(tmp_path, max_wait_s=600, pool_cap=3, pool_contended_cap=1) as stack:
        stack.gate.clear()
        results: list[Any] = []
        threads = _in_threads([lambda: _send(stack, "heavy", results) for _ in range(2)])
        assert wait_until(lambda: len(stack.decode.requests) == 2, 30), "heavy not on the pair"
        threads += _in_threads([lambda: _send(stack, "light", results)])
        assert wait_until(lambda: len(stack.decode.requests) == 3, 30), "light waited"
        threads += _in_threads([lambda: _send(stack, "heavy", results)])
        assert wait_until(lambda: _queued(stack) == 1, 30), _queued(stack)
        on_the_pair = [
            (r["_headers"]["x-isolation-tenant"], r["priority"]) for r in stack.decode.requests
        ]
        assert sorted(on_the_pair) == [("heavy", 200), ("heavy", 250), ("light", 250)]
        assert on_the_pair[2] == ("light", 250)
        # Prefill was told the same as decode, request by request.
        assert stack.prefill is not None
        by_rid = {r["rid"]: r["priority"] for r in stack.prefill.requests}
        assert all(by_rid[r["rid"]] == r["priority"] for r in stack.decode.requests)
        stack.gate.set()
        for thread in threads:
            thread.join(60)
        assert [status for status, _ in results] == [200] * 4


def _completion(stack: GatedStack, tenant: str, results: list[Any], **fields: Any) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}
    with stack.client(tenant) as client:
        response = client.post("/v1/completions", json=body)
    results.append((response.status_code, response.json()))


def test_each_generation_of_a_request_waits_its_own_turn_and_is_charged(
    patient: GatedStack,
) -> None:
    """A request of two prompts x n=2 is four generations: on a pair of one slot they go one
    at a time, each in its turn, alternating with another tenant's four requests of one
    generation each (equal weights, equal costs), not all four together."""
    results: list[Any] = []
    threads = _hold_the_pair(patient, results)
    threads += _in_threads(
        [lambda: _completion(patient, "heavy", results, prompt=["hi", "ho"], n=2)]
    )
    assert wait_until(lambda: _queued(patient) == 1, 30), _queued(patient)
    threads += _in_threads([lambda: _send(patient, "light", results) for _ in range(4)])
    # heavy's first generation and light's four: heavy's others wait for its first to end.
    assert wait_until(lambda: _queued(patient) == 5, 30), _queued(patient)
    patient.gate.set()
    for thread in threads:
        thread.join(60)
    assert [status for status, _ in results] == [200] * 6
    whole = next(body for _, body in results if body and len(body.get("choices", [])) == 4)
    assert sorted(choice["index"] for choice in whole["choices"]) == [0, 1, 2, 3]
    served = patient.served_tenants()[1:]
    assert served.count("heavy") == 4
    # Never two of heavy's generations in a row while light still waited.
    light_done = max(i for i, tenant in enumerate(served) if tenant == "light")
    pairs = itertools.pairwise(served[: light_done + 1])
    assert not any(a == b == "heavy" for a, b in pairs), served
    assert patient.claimed_tokens() == 0


def test_best_of_candidates_are_generations_of_their_own(patient: GatedStack) -> None:
    results: list[Any] = []
    patient.gate.set()
    patient.decode.requests.clear()
    _completion(patient, "heavy", results, best_of=3, n=1, logprobs=1)
    assert results[0][0] == 200 and len(results[0][1]["choices"]) == 1
    assert len(patient.decode.requests) == 3
    assert patient.claimed_tokens() == 0


def test_a_stream_whose_generations_could_never_fit_one_requests_share_is_refused(
    patient: GatedStack,
) -> None:
    """The pool's cap is one slot: one request may hold one generation at once. A whole answer
    of two runs them in turn; a stream, whose generations all run at once, is a 400 that says
    why, before any worker is asked."""
    patient.gate.set()
    patient.decode.requests.clear()
    with patient.client("light") as client:
        refused = client.post("/v1/chat/completions", json={**_body(True), "n": 2})
        whole = client.post("/v1/chat/completions", json={**_body(), "n": 2})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "n"
    assert "at most 1 generations" in error["message"]
    assert whole.status_code == 200 and len(whole.json()["choices"]) == 2
    assert len(patient.decode.requests) == 2  # the whole answer's two; nothing of the stream's
    assert patient.claimed_tokens() == 0
