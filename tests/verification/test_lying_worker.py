"""Gates 2-3 from the outside: a worker that lies never gets a byte of its answer to the client.

Each lie ends in the fail-closed outcome: a non-streamed answer becomes HTTP 502
``isolation_check_failed`` with no content; a stream whose first chunk lies becomes HTTP 502
before any byte is sent; a stream that starts honest and then lies ends with exactly one
error event (no ``[DONE]``). The lie's text never reaches the client, the failure is in the
metrics, and the tenant's audit log records ``verification_failed``.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from gateway.verification.scanner import MARKER_PREFIX, CanaryScanner, new_marker
from tests.standin_worker import Behaviour
from tests.verification.stack import (
    MODEL,
    POOL_TOKENS,
    LyingStack,
    lying_stack,
    sse_events,
    sse_payloads,
    streamed_content,
    wait_until,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
CANARY_KEY = "isogate-test-verify-canary-" + secrets.token_hex(6)

HONEST = "An honest opening that is long enough to pass the hold-back. "
LEAK = "LEAKED-TEXT-OF-SOMEONE-ELSE"

# name → (the lie, a phrase of the reason the audit event must give)
LIES: dict[str, tuple[Behaviour, str]] = {
    "wrong generation ID": (Behaviour(wrong_generation=True), "another generation ID"),
    "wrong tenant": (Behaviour(wrong_tenant=True), "another tenant"),
    "wrong meta_info.id": (Behaviour(wrong_meta_id=True), "meta_info.id"),
    "short prompt_tokens": (Behaviour(prompt_tokens_delta=-1), "prompt tokens"),
    "too many completion_tokens": (Behaviour(extra_completion_tokens=50), "completion_tokens"),
    "no tags at all": (Behaviour(echo_tags=False), "did not echo"),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    env = {
        "ISOGATE_REDIS_URL": REDIS_URL,
        "ISOGATE_CANARY_REDIS_KEY": CANARY_KEY,
        "ISOGATE_CANARY_REFRESH_S": "0.1",
        "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.05",
    }
    with lying_stack(tmp_path_factory.mktemp("lying"), env=env) as running:
        yield running
    import redis

    redis.from_url(REDIS_URL).delete(CANARY_KEY)


@pytest.fixture
def tenant_key(stack: LyingStack) -> str:
    return stack.gateway.create_tenant()[1]


def behave(stack: LyingStack, behaviour: Behaviour) -> None:
    stack.decode.behaviour = replace(behaviour, pool_tokens=POOL_TOKENS)


def stream_in_two_parts(
    stack: LyingStack, tenant_key: str, rest: threading.Event
) -> tuple[httpx.Response, bytes, list[Any]]:
    """A streamed chat request whose worker holds all but its first chunk (``rest_of_stream``)
    until the client has the first bytes: the honest first chunk is answered before the rest
    exists. Without that, on a busy machine the chunks can reach the gateway in one read, and
    the gateway then rightly withholds the whole answer (a 502, not a stream that ends in an
    error). Returns the response, its raw body and its events."""
    with (
        stack.client(tenant_key) as client,
        client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as response,
    ):
        chunks = response.iter_raw()
        raw = next(chunks, b"")
        rest.set()
        raw += b"".join(chunks)
    return response, raw, sse_payloads(raw.decode().splitlines())


def body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 4,
        "stream": stream,
    }


def audited_failure(
    stack: LyingStack, key: str, response: httpx.Response | None = None
) -> dict[str, Any]:
    def events() -> list[dict[str, Any]]:
        with stack.client(key) as client:
            return client.get("/v1/audit/events", params={"outcome": "verification_failed"}).json()[
                "data"
            ]

    found = wait_until(events, timeout_s=10)
    assert len(found) == 1, found
    event = found[0]
    # The event is the request the decode worker saw, and the one the client was told about.
    assert event["generation_id"] == stack.decode.requests[-1]["rid"]
    if response is not None:
        assert response.headers["x-generation-id"] == event["generation_id"]
    assert event["code"] == "isolation_check_failed"
    return event


def assert_withheld_502(response: httpx.Response) -> None:
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "isolation_check_failed"
    assert set(response.json()) == {"error"}
    assert LEAK not in response.text and HONEST not in response.text


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_answer_is_withheld_with_502(stack: LyingStack, tenant_key: str, lie: str) -> None:
    behaviour, reason = LIES[lie]
    behave(stack, replace(behaviour, text_chunks=(HONEST, LEAK)))
    failures_before = stack.metric("isogate_verification_failures_total")
    with stack.client(tenant_key) as client:
        response = client.post("/v1/chat/completions", json=body(stream=False))
    assert_withheld_502(response)
    event = audited_failure(stack, tenant_key, response)
    assert reason in event["detail"] and event["status"] == 502 and event["stream"] is False
    assert stack.metric("isogate_verification_failures_total") == failures_before + 1


@pytest.mark.parametrize("lie", list(LIES))
def test_a_stream_whose_first_chunk_lies_is_a_502_before_any_byte(
    stack: LyingStack, tenant_key: str, lie: str
) -> None:
    behaviour, reason = LIES[lie]
    behave(stack, replace(behaviour, text_chunks=(LEAK + " ", LEAK), lie_from_chunk=0))
    with (
        stack.client(tenant_key) as client,
        client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as response,
    ):
        response.read()
    assert_withheld_502(response)
    assert b"data:" not in response.content
    event = audited_failure(stack, tenant_key, response)
    assert reason in event["detail"] and event["status"] == 502 and event["stream"] is True


@pytest.mark.parametrize(
    "lie", [name for name in LIES if name != "no tags at all"]
)  # tags are all-or-nothing
def test_a_stream_that_lies_midway_ends_with_one_error_event_and_no_done(
    stack: LyingStack, tenant_key: str, lie: str
) -> None:
    behaviour, reason = LIES[lie]
    rest = threading.Event()
    behave(
        stack,
        replace(
            behaviour,
            text_chunks=(HONEST, LEAK, " and more"),
            lie_from_chunk=1,
            rest_of_stream=rest,
        ),
    )
    response, raw, events = stream_in_two_parts(stack, tenant_key, rest)
    assert response.status_code == 200
    assert LEAK.encode() not in raw
    assert HONEST.startswith(
        streamed_content(events)
    )  # only the honest chunk's checked part got out
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "isolation_check_failed"
    assert sum(1 for e in events if isinstance(e, dict) and "error" in e) == 1
    event = audited_failure(stack, tenant_key, response)
    assert reason in event["detail"] and event["stream"] is True


def test_the_honest_stand_in_is_served(stack: LyingStack, tenant_key: str) -> None:
    """The control: the same stack, with nothing lying, serves both ways (so the tests above can
    fail)."""
    behave(stack, Behaviour(text_chunks=(HONEST, "done.")))
    with stack.client(tenant_key) as client:
        whole = client.post("/v1/chat/completions", json=body(stream=False))
        with client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as response:
            response.read()
            events = sse_events(response)
    assert (
        whole.status_code == 200
        and whole.json()["choices"][0]["message"]["content"] == HONEST + "done."
    )
    assert streamed_content(events) == HONEST + "done." and events[-1] == "[DONE]"


# ---- canaries ----------------------------------------------------------------------------


def publish_marker(stack: LyingStack, owner: str) -> str:
    """Register ``owner``'s marker the way another replica's prober would: through Redis."""
    import asyncio

    import redis.asyncio as redis_asyncio

    async def register(marker: str) -> None:
        client = redis_asyncio.from_url(REDIS_URL)
        try:
            await CanaryScanner(client, CANARY_KEY).register_marker(
                marker, owner, 120, origin="test"
            )
        finally:
            await client.aclose()

    before = stack.metric("isogate_canary_live_markers")
    marker = new_marker()
    asyncio.run(register(marker))
    assert wait_until(lambda: stack.metric("isogate_canary_live_markers") > before, timeout_s=10)
    return marker


def test_another_tenants_canary_split_across_two_chunks_ends_the_stream(
    stack: LyingStack, tenant_key: str
) -> None:
    marker = publish_marker(stack, owner="tenant-b")
    cut = len(MARKER_PREFIX) + 4
    rest = threading.Event()
    behave(
        stack,
        Behaviour(
            text_chunks=(HONEST, "as I recall " + marker[:cut], marker[cut:] + " the end"),
            rest_of_stream=rest,
        ),
    )
    hits_before = stack.metric("isogate_canary_hits_total")
    response, raw, events = stream_in_two_parts(stack, tenant_key, rest)
    assert response.status_code == 200
    content = streamed_content(events)
    assert (HONEST + "as I recall ").startswith(content) and content  # some honest text got out ...
    assert (
        MARKER_PREFIX[0].encode() not in raw and marker[cut:].encode() not in raw
    )  # ... none of the marker
    assert events[-1]["error"]["code"] == "isolation_check_failed" and "[DONE]" not in events
    assert stack.metric("isogate_canary_hits_total") == hits_before + 1
    assert "canary" in audited_failure(stack, tenant_key)["detail"]


def test_another_tenants_canary_in_a_whole_answer_is_a_502(
    stack: LyingStack, tenant_key: str
) -> None:
    marker = publish_marker(stack, owner="tenant-b")
    behave(stack, Behaviour(text_chunks=("prefix ", marker, " suffix")))
    with stack.client(tenant_key) as client:
        response = client.post("/v1/chat/completions", json=body(stream=False))
    assert_withheld_502(response)
    assert marker not in response.text and "suffix" not in response.text
    assert "canary" in audited_failure(stack, tenant_key)["detail"]


def test_a_tenants_own_canary_marker_is_served(stack: LyingStack) -> None:
    tenant_id, key = stack.gateway.create_tenant()
    marker = publish_marker(stack, owner=tenant_id)
    behave(stack, Behaviour(text_chunks=("mine: ", marker)))
    with stack.client(key) as client:
        response = client.post("/v1/chat/completions", json=body(stream=False))
    assert (
        response.status_code == 200
        and response.json()["choices"][0]["message"]["content"] == "mine: " + marker
    )
