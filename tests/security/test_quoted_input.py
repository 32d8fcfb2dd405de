"""What a client sends is never echoed back whole: an error quotes a short prefix of it (a 5 MB
model name got a 5 MB 404), and no redirect carries the client's Host header.

Against a gateway process in front of stand-in workers (the security suite's stack, which takes
bodies up to 1 MB).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.common.errors import MESSAGE_CHARS, QUOTE_CHARS
from tests.reliability.stack import MODEL, StandInStack, chat_body
from tests.security.conftest import FUZZ_MAX_BODY_BYTES

HUGE_NAME = "m" * (FUZZ_MAX_BODY_BYTES - 4096)  # the largest that fits a body here


@pytest.fixture(scope="module")
def client(stack: StandInStack) -> Iterator[httpx.Client]:
    with stack.client(stack.key("quoted-input"), timeout_s=30) as http:
        yield http


def _post(client: httpx.Client, path: str, body: dict[str, object]) -> httpx.Response:
    return client.post(
        path, content=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(model=HUGE_NAME)),
        ("/v1/completions", {"model": HUGE_NAME, "prompt": "x", "max_tokens": 1}),
        ("/v1/tokenize", {"model": HUGE_NAME, "prompt": "x"}),
    ],
    ids=["chat", "completions", "tokenize"],
)
def test_an_unknown_models_404_quotes_a_prefix_of_its_name(
    client: httpx.Client, path: str, body: dict[str, object]
) -> None:
    response = _post(client, path, body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert "m" * QUOTE_CHARS in error["message"]
    assert len(response.content) < 4 * QUOTE_CHARS + 200


def test_a_model_card_for_a_long_unknown_name_is_a_short_404(client: httpx.Client) -> None:
    response = client.get("/v1/models/" + "m" * 16_000)
    assert response.status_code == 404
    assert len(response.content) < MESSAGE_CHARS + 200


def test_an_unknown_field_with_a_huge_name_is_named_by_a_prefix(client: httpx.Client) -> None:
    response = _post(client, "/v1/chat/completions", {**chat_body(), HUGE_NAME: 1})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unknown_parameter"
    assert len(response.content) < 4 * QUOTE_CHARS + 200


@pytest.mark.parametrize(
    ("method", "path", "location"),
    [("GET", "/healthz/", "/healthz"), ("POST", "/v1/chat/completions/", "/v1/chat/completions")],
)
def test_a_redirect_never_carries_the_clients_host(
    client: httpx.Client, method: str, path: str, location: str
) -> None:
    response = client.request(
        method,
        path,
        content=orjson.dumps(chat_body(model=MODEL)),
        headers={"Host": "evil.example", "Content-Type": "application/json"},
    )
    assert response.status_code == 307
    assert response.headers["location"] == location


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/audit/events?" + "q" * 16_000 + "=1", 400),  # an unknown query parameter
        ("/v1/audit/events/" + "g" * 16_000, 404),  # no such event
    ],
    ids=["unknown parameter", "unknown event"],
)
def test_the_audit_routes_quote_a_prefix_of_a_name(
    client: httpx.Client, path: str, status: int
) -> None:
    response = client.get(path)
    assert response.status_code == status
    assert len(response.json()["error"]["message"]) < 2 * QUOTE_CHARS
