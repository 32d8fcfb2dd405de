"""How the pipeline reads a request (headers in one pass, the body from ASGI) and writes a served
one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from gateway.api.pipeline import ClientHeaders, JSONBodyResponse, read_body
from gateway.common.errors import APIError
from gateway.server.http_server import (
    DISCONNECT_EXTENSION,
    HEADER_LINES_EXTENSION,
    DisconnectHook,
    header_pairs,
)


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "headers": list(headers)}


def receiver(*messages: dict[str, Any]):  # type: ignore[no-untyped-def]
    queue = list(messages)
    calls = []

    async def receive() -> dict[str, Any]:
        calls.append(1)
        return queue.pop(0)

    receive.calls = calls  # type: ignore[attr-defined]
    return receive


def test_the_first_authorization_header_counts_as_starlette_reads_it() -> None:
    headers = ClientHeaders.of(
        scope(
            (b"authorization", b"Bearer first"),
            (b"content-length", b"12"),
            (b"authorization", b"Bearer second"),
        )
    )
    assert headers == ClientHeaders("Bearer first", "12", None)


def test_a_reserved_header_is_found_whatever_its_position() -> None:
    headers = ClientHeaders.of(
        scope(
            (b"host", b"x"),
            (b"x-isogate-tenant", b"a"),
            (b"x-isolation-generation", b"b"),
            (b"authorization", b"Bearer k"),
        )
    )
    assert headers.reserved == "x-isogate-tenant"
    assert headers.authorization == "Bearer k"
    assert ClientHeaders.of(scope((b"x-isolationist", b"1"))).reserved is None


def test_a_body_in_several_messages_is_joined() -> None:
    receive = receiver(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": True},
        {"type": "http.request", "body": b"", "more_body": False},
    )
    assert asyncio.run(read_body({"type": "http"}, receive, None, 10, 5.0)) == b"abcd"


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    receive = receiver({"type": "http.request", "body": b"x" * 11})
    with pytest.raises(APIError) as refused:
        asyncio.run(read_body({"type": "http"}, receive, "11", 10, 5.0))
    assert refused.value.status == 413 and receive.calls == []  # type: ignore[attr-defined]


def test_an_undeclared_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    receive = receiver(
        {"type": "http.request", "body": b"x" * 6, "more_body": True},
        {"type": "http.request", "body": b"x" * 6, "more_body": True},
        {"type": "http.request", "body": b"never read", "more_body": False},
    )
    with pytest.raises(APIError) as refused:
        asyncio.run(read_body({"type": "http"}, receive, None, 10, 5.0))
    assert refused.value.code == "request_too_large" and len(receive.calls) == 2  # type: ignore[attr-defined]


def test_a_client_that_leaves_mid_body_is_a_disconnect_not_a_short_body() -> None:
    receive = receiver(
        {"type": "http.request", "body": b'{"mod', "more_body": True}, {"type": "http.disconnect"}
    )
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_body({"type": "http"}, receive, None, 100, 5.0))


def test_a_body_the_server_refused_mid_way_is_that_refusal_not_a_disconnect() -> None:
    hook = DisconnectHook()
    hook.refused = APIError(408, "late", "invalid_request_error", "request_timeout")
    scope = {"type": "http", "extensions": {DISCONNECT_EXTENSION: {"hook": hook}}}
    receive = receiver(
        {"type": "http.request", "body": b'{"mod', "more_body": True}, {"type": "http.disconnect"}
    )
    with pytest.raises(APIError) as refused:
        asyncio.run(read_body(scope, receive, None, 100, 5.0))
    assert refused.value.status == 408


def test_a_served_response_declares_its_length_type_and_generation_id_as_the_request_id() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(JSONBodyResponse(b'{"id":"gen_1"}', "gen_1")({"type": "http"}, receiver(), send))
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"]) == {
        b"content-type": b"application/json",
        b"content-length": b"14",
        b"x-generation-id": b"gen_1",
        b"x-request-id": b"gen_1",  # what the OpenAI SDK reads as _request_id
    }
    assert sent[1]["body"] == b'{"id":"gen_1"}'


def test_a_served_response_in_pieces_declares_their_whole_length_and_sends_them_in_order() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    pieces = [b'{"choices":[', b'{"index":0}', b",", b'{"index":1}', b"]}"]
    asyncio.run(JSONBodyResponse(pieces, "gen_1")({"type": "http"}, receiver(), send))
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(b"".join(pieces))).encode()
    assert [message["body"] for message in sent[1:]] == pieces
    assert [message["more_body"] for message in sent[1:]] == [True] * 4 + [False]


def test_a_served_response_gives_the_gateways_server_its_head_as_lines() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    response = JSONBodyResponse(b"{}", "gen_1", b"x-ratelimit-limit-requests: 60\r\n")
    scope = {"type": "http", "extensions": {HEADER_LINES_EXTENSION: {}}}
    asyncio.run(response(scope, receiver(), send))
    assert sent[0]["headers"] == []
    assert (
        header_pairs(sent[0][HEADER_LINES_EXTENSION])
        == response.raw_headers
        == [
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
            (b"x-generation-id", b"gen_1"),
            (b"x-request-id", b"gen_1"),
            (b"x-ratelimit-limit-requests", b"60"),
        ]
    )
