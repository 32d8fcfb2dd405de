"""The Responses API is checked as chat is: a worker that lies never gets a byte of its answer to
the client, and a response withheld is never stored.

A whole answer that lies is a 502 ``isolation_check_failed``; a stream that starts honest and
then lies ends with the ``error`` event and ``response.failed`` (no ``response.completed``),
only the checked text sent; both are audited ``verification_failed`` under the response's id,
and neither can be retrieved or chained from afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest

from tests.standin_worker import Behaviour
from tests.verification.stack import MODEL, POOL_TOKENS, LyingStack, lying_stack, wait_until

HONEST = "An honest opening that is long enough to pass the hold-back. "
LEAK = "LEAKED-TEXT-OF-SOMEONE-ELSE"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    env = {"ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.05"}
    with lying_stack(tmp_path_factory.mktemp("lying-responses"), env=env) as running:
        yield running


@pytest.fixture
def tenant_key(stack: LyingStack) -> str:
    return stack.gateway.create_tenant()[1]


def behave(stack: LyingStack, behaviour: Behaviour) -> None:
    stack.decode.behaviour = replace(behaviour, pool_tokens=POOL_TOKENS)


def body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "input": "Say something.", "max_output_tokens": 4, "stream": stream}


def events_of(raw: bytes) -> list[dict[str, Any]]:
    return [
        orjson.loads(line.removeprefix("data: "))
        for line in raw.decode().splitlines()
        if line.startswith("data: ")
    ]


def audited(stack: LyingStack, key: str, generation_id: str) -> dict[str, Any]:
    def event() -> dict[str, Any] | None:
        with stack.client(key) as client:
            found = client.get(f"/v1/audit/events/{generation_id}")
        return found.json() if found.status_code == 200 else None

    assert wait_until(event, timeout_s=10), "no audit event under the response's id"
    found = event()
    assert found is not None
    return found


def never_stored(stack: LyingStack, key: str, response_id: str) -> None:
    with stack.client(key) as client:
        assert client.get(f"/v1/responses/{response_id}").status_code == 404
        chained = client.post(
            "/v1/responses", json={**body(False), "previous_response_id": response_id}
        )
        assert chained.status_code == 404


def test_a_whole_response_that_lies_is_withheld_and_not_stored(
    stack: LyingStack, tenant_key: str
) -> None:
    behave(stack, Behaviour(wrong_tenant=True, text_chunks=(HONEST, LEAK)))
    with stack.client(tenant_key) as client:
        response = client.post("/v1/responses", json=body(stream=False))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "isolation_check_failed"
    assert LEAK not in response.text and HONEST not in response.text
    response_id = response.headers["x-generation-id"]
    assert audited(stack, tenant_key, response_id)["outcome"] == "verification_failed"
    behave(stack, Behaviour())
    never_stored(stack, tenant_key, response_id)


def test_a_stream_that_lies_midway_ends_with_response_failed_and_nothing_unchecked(
    stack: LyingStack, tenant_key: str
) -> None:
    rest = threading.Event()
    behave(
        stack,
        Behaviour(
            wrong_tenant=True,
            text_chunks=(HONEST, LEAK, " and more"),
            lie_from_chunk=1,
            rest_of_stream=rest,
        ),
    )
    with (
        stack.client(tenant_key) as client,
        client.stream("POST", "/v1/responses", json=body(stream=True)) as response,
    ):
        # The honest first chunk is answered before the rest exists (see test_lying_worker).
        chunks = response.iter_raw()
        raw = next(chunks, b"")
        rest.set()
        raw += b"".join(chunks)
    assert response.status_code == 200
    assert LEAK.encode() not in raw
    events = events_of(raw)
    types = [event["type"] for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types and "response.output_text.done" not in types
    assert events[-2]["code"] == "isolation_check_failed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert HONEST.startswith(sent)  # only the honest chunk's checked part got out
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    response_id = failed["id"]
    assert response.headers["x-generation-id"] == response_id
    event = audited(stack, tenant_key, response_id)
    assert event["outcome"] == "verification_failed" and event["stream"] is True
    behave(stack, Behaviour())
    never_stored(stack, tenant_key, response_id)


def test_the_honest_stand_in_is_served_and_stored(stack: LyingStack, tenant_key: str) -> None:
    """The control: nothing lying, the same requests are answered and stored both ways."""
    behave(stack, Behaviour(text_chunks=(HONEST, "done.")))
    with stack.client(tenant_key) as client:
        whole = client.post("/v1/responses", json=body(stream=False))
        streamed = client.post("/v1/responses", json=body(stream=True))
        assert whole.status_code == streamed.status_code == 200
        events = events_of(streamed.content)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        for response_id in (whole.json()["id"], events[-1]["response"]["id"]):
            stored: httpx.Response = client.get(f"/v1/responses/{response_id}")
            assert stored.status_code == 200
            assert stored.json()["output"][0]["content"][0]["text"] == HONEST + "done."
