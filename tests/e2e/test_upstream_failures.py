"""Upstream failures become clear OpenAI errors with the right status, never a hang or a 200.

Stand-in workers are used because real SGLang does not hang or drop connections on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.dev.harness import GatewayProcess, free_port
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "standin-model"


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from gateway.dev.model import ensure_tiny_model

    return ensure_tiny_model()


def _gateway(
    tmp: Path, tokenizer_dir: Path, prefill: str, decode: str, **env: str
) -> GatewayProcess:
    policies = write_policies(
        tmp / "policies",
        model_name=MODEL,
        tokenizer_dir=tokenizer_dir,
        pools=[PoolSpec("shared", ((prefill, 1),), (decode,))],
    )
    return GatewayProcess(policies_dir=policies, work_dir=tmp, env=env)


@pytest.fixture
def workers() -> Iterator[tuple[StandInWorker, StandInWorker]]:
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    yield prefill, decode
    prefill.stop()
    decode.stop()


def _chat(gateway: GatewayProcess, key: str, **extra: object) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        **extra,
    }
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
    )


def test_a_hung_decode_worker_is_a_504_within_the_timeout(tmp_path, tokenizer_dir, workers) -> None:
    prefill, decode = workers
    decode.behaviour = Behaviour(hang=True)
    with _gateway(
        tmp_path, tokenizer_dir, prefill.url, decode.url, ISOGATE_UPSTREAM_TIMEOUT_S="1.5"
    ) as gateway:
        _, key = gateway.create_tenant()
        started = time.monotonic()
        for stream in (False, True):
            response = _chat(gateway, key, stream=stream)
            assert response.status_code == 504
            assert response.json()["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - started < 10


def test_a_worker_that_drops_the_connection_is_a_503(tmp_path, tokenizer_dir, workers) -> None:
    prefill, decode = workers
    decode.behaviour = Behaviour(drop_connection=True)
    with _gateway(tmp_path, tokenizer_dir, prefill.url, decode.url) as gateway:
        _, key = gateway.create_tenant()
        response = _chat(gateway, key)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "worker_unavailable"


def test_a_failing_prefill_fails_the_request_with_502(tmp_path, tokenizer_dir, workers) -> None:
    prefill, decode = workers
    prefill.behaviour = Behaviour(status=500)
    decode.behaviour = Behaviour(hang=True)  # decode would wait for a transfer that never comes
    with _gateway(
        tmp_path, tokenizer_dir, prefill.url, decode.url, ISOGATE_UPSTREAM_TIMEOUT_S="20"
    ) as gateway:
        _, key = gateway.create_tenant()
        for stream in (False, True):
            started = time.monotonic()
            response = _chat(gateway, key, stream=stream)
            assert response.status_code == 502
            assert time.monotonic() - started < 10  # failed fast, did not wait for decode's timeout


def test_workers_that_never_answered_are_not_routed_to(tmp_path, tokenizer_dir) -> None:
    dead_prefill, dead_decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    gateway = _gateway(tmp_path, tokenizer_dir, dead_prefill, dead_decode).start(wait_ready=False)
    try:
        _, key = gateway.create_tenant()
        assert httpx.get(gateway.url + "/readyz").status_code == 503
        response = _chat(gateway, key)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_worker_available"
        assert int(response.headers["Retry-After"]) >= 1
    finally:
        gateway.stop()


def test_a_worker_that_stops_answering_is_taken_out_once_its_data_is_stale(
    tmp_path, tokenizer_dir, workers
) -> None:
    prefill, decode = workers
    with _gateway(
        tmp_path, tokenizer_dir, prefill.url, decode.url, ISOGATE_CAPACITY_STALE_AFTER_S="1.5"
    ) as gateway:
        _, key = gateway.create_tenant()
        assert _chat(gateway, key).status_code == 200
        decode.stop()
        time.sleep(2.5)
        response = _chat(gateway, key)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_worker_available"


def test_a_client_that_leaves_mid_stream_releases_its_claims_and_is_audited(
    tmp_path, tokenizer_dir, workers
) -> None:
    prefill, decode = workers
    decode.behaviour = Behaviour(
        text_chunks=tuple(f"w{i} " for i in range(500))
    )  # ~5 s of streaming
    with _gateway(tmp_path, tokenizer_dir, prefill.url, decode.url) as gateway:
        _, key = gateway.create_tenant()
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 600,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            gateway.url + "/v1/chat/completions",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
        ) as response:
            generation_id = response.headers["X-Generation-Id"]
            next(response.iter_lines())  # the first event arrived; now hang up
        deadline = time.monotonic() + 3  # well before the stream would have ended by itself
        event = None
        while time.monotonic() < deadline:
            found = httpx.get(
                f"{gateway.url}/v1/audit/events/{generation_id}",
                headers={"Authorization": f"Bearer {key}"},
            )
            if found.status_code == 200:
                event = found.json()
                break
            time.sleep(0.1)
        assert event is not None and event["outcome"] == "client_cancelled"
        with gateway.admin() as admin:
            claimed = {
                w["url"]: w["claimed_tokens"] for w in admin.get("/admin/workers").json()["data"]
            }
        assert claimed == {prefill.url: 0, decode.url: 0}


def test_a_client_that_leaves_before_its_body_arrived_is_audited_as_cancelled(
    tmp_path, tokenizer_dir, workers
) -> None:
    import socket
    from urllib.parse import urlsplit

    prefill, decode = workers
    with _gateway(tmp_path, tokenizer_dir, prefill.url, decode.url) as gateway:
        _, key = gateway.create_tenant()
        address = urlsplit(gateway.url)
        with socket.create_connection((address.hostname, address.port), timeout=10) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Type: application/json\r\n"
                b"Authorization: Bearer "
                + key.encode()
                + b'\r\nContent-Length: 1000\r\n\r\n{"model"'
            )
            time.sleep(0.3)  # the request is being read; now hang up
        deadline = time.monotonic() + 5
        events: list[dict] = []
        while time.monotonic() < deadline and not events:
            events = httpx.get(
                f"{gateway.url}/v1/audit/events", headers={"Authorization": f"Bearer {key}"}
            ).json()["data"]
            time.sleep(0.1)
        assert [(event["outcome"], event["status"]) for event in events] == [
            ("client_cancelled", 499)
        ]
        assert "unexpected error" not in gateway.log_tail()


def test_a_request_given_up_on_is_aborted_on_both_workers_by_its_rid(
    tmp_path, tokenizer_dir, workers
) -> None:
    prefill, decode = workers
    with _gateway(
        tmp_path, tokenizer_dir, prefill.url, decode.url, ISOGATE_UPSTREAM_TIMEOUT_S="1.5"
    ) as gateway:
        _, key = gateway.create_tenant()
        for stream in (False, True):  # served to the end: nothing to abort
            assert _chat(gateway, key, stream=stream).status_code == 200
        assert prefill.aborted == [] and decode.aborted == []
        decode.behaviour = Behaviour(hang=True)
        for stream in (False, True):
            response = _chat(gateway, key, stream=stream)
            assert response.status_code == 504
            rid = response.headers["X-Generation-Id"]
            assert _until(lambda rid=rid: rid in prefill.aborted and rid in decode.aborted)


def test_a_non_streaming_client_that_leaves_is_aborted_released_and_audited(
    tmp_path, tokenizer_dir, workers
) -> None:
    prefill, decode = workers
    decode.behaviour = Behaviour(hang=True)  # the generation would outlast the client
    with _gateway(tmp_path, tokenizer_dir, prefill.url, decode.url) as gateway:
        tenant_id, key = gateway.create_tenant()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gateway.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {key}"},
                timeout=httpx.Timeout(10, read=0.3),
            )
        with gateway.admin() as admin:

            def events() -> list[dict]:
                return admin.get("/v1/audit/events", params={"tenant": tenant_id}).json()["data"]

            recorded = _until(events)
            assert [(e["outcome"], e["status"]) for e in recorded] == [("client_cancelled", 499)]
            rid = recorded[0]["generation_id"]
            assert _until(lambda: rid in prefill.aborted and rid in decode.aborted)
            claimed = {
                w["url"]: w["claimed_tokens"] for w in admin.get("/admin/workers").json()["data"]
            }
        assert claimed == {prefill.url: 0, decode.url: 0}


def _until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    return predicate()


def _worker_view(gateway: GatewayProcess, url: str) -> dict:
    with gateway.admin() as admin:
        (view,) = [w for w in admin.get("/admin/workers").json()["data"] if w["url"] == url]
        return view


def test_a_worker_slow_on_capacity_polls_but_serving_is_routed_to_for_a_bounded_time(
    tmp_path, tokenizer_dir, workers
) -> None:
    prefill, decode = workers
    with _gateway(
        tmp_path,
        tokenizer_dir,
        prefill.url,
        decode.url,
        # Polls time out after 2 s: a failed poll (the harness polls every 0.5 s, and a timeout
        # may fire 0.5 s late) is seen, and /health renews liveness, well inside the window.
        ISOGATE_CAPACITY_STALE_AFTER_S="4",
        ISOGATE_CAPACITY_MAX_AGE_IF_ALIVE_S="8",
    ) as gateway:
        _, key = gateway.create_tenant()
        assert _chat(gateway, key).status_code == 200
        decode.behaviour = Behaviour(capacity_delay_s=60)  # busy: polls time out, it serves
        slow = _until(
            lambda: not (view := _worker_view(gateway, decode.url))["capacity_fresh"] and view,
            timeout_s=30,
        )
        assert slow and not slow["capacity_fresh"] and slow["alive"], slow
        # Routed on its last record: served, not 503.
        assert _chat(gateway, key).status_code == 200
        with gateway.admin() as admin:
            metrics = admin.get("/metrics").text
        assert (
            f'isogate_worker_capacity_fresh{{role="decode",worker="{decode.url}"}} 0.0' in metrics
        )
        assert f'isogate_worker_alive{{role="decode",worker="{decode.url}"}} 1.0' in metrics
        # For a bounded time: once the record is older than the bound, it is not routed on.
        assert _until(lambda: not _worker_view(gateway, decode.url)["fresh"], timeout_s=30)
        response = _chat(gateway, key)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "no_worker_available"


@pytest.mark.parametrize("how", ["stopped", "health_503"])
def test_a_worker_that_fails_its_liveness_probe_is_taken_out_however_young_its_record(
    tmp_path, tokenizer_dir, workers, how: str
) -> None:
    prefill, decode = workers
    with _gateway(
        tmp_path,
        tokenizer_dir,
        prefill.url,
        decode.url,
        ISOGATE_CAPACITY_STALE_AFTER_S="10",  # polls time out after 5 s
        ISOGATE_CAPACITY_MAX_AGE_IF_ALIVE_S="600",  # only liveness can take it out early
    ) as gateway:
        _, key = gateway.create_tenant()
        assert _chat(gateway, key).status_code == 200
        if how == "stopped":
            decode.stop()
        else:  # it still accepts connections, but neither polls nor /health succeed
            decode.behaviour = Behaviour(capacity_delay_s=60, health_status=503)
        dead = _until(
            lambda: (view := _worker_view(gateway, decode.url))["liveness_error"] and view
        )
        assert dead and not dead["alive"] and not dead["fresh"], dead
        response = _chat(gateway, key)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "no_worker_available"
