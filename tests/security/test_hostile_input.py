"""Hostile bytes at the generation routes: what a schema cannot describe, and every field set to
anything.

Schema-driven fuzzing sends JSON. These send what a hostile or broken client does: arbitrary
bytes, invalid UTF-8, NaN, 100,000-deep nesting, integers past 64 bits, bodies past the size
limit (declared and chunked), numbers at and past every bound, odd ``stream`` values,
enormous message lists, and (property-based) any JSON value in any field. The answer is always
a 4xx carrying one clean OpenAI error object, and the gateway stays up and keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.stack import MODEL, StandInStack, chat_body
from tests.security.checks import assert_clean_error, assert_no_server_error
from tests.security.conftest import FUZZ_CASES, FUZZ_MAX_BODY_BYTES

ROUTES = ("/v1/chat/completions", "/v1/completions")
FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "echo",
)
FUZZ_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=50),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def client(stack: StandInStack) -> Iterator[httpx.Client]:
    with stack.client(stack.key("hostile-input"), timeout_s=30) as http:
        yield http


def _post(client: httpx.Client, route: str, content: bytes, **headers: str) -> httpx.Response:
    FUZZ_CASES[f"hand-written POST {route}"] += 1
    return client.post(
        route, content=content, headers={"Content-Type": "application/json", **headers}
    )


def _completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Say hello.", "max_tokens": 4, **extra}


def _valid_body(route: str, **extra: Any) -> dict[str, Any]:
    return chat_body(**extra) if route == ROUTES[0] else _completion_body(**extra)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("empty", b""),
        ("whitespace", b"   \n"),
        ("truncated", b'{"model": "tiny-llama", "messages": ['),
        ("not an object", b"[1, 2, 3]"),
        ("bare string", b'"hello"'),
        ("null", b"null"),
        (
            "invalid utf-8 in a string",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe\xc0"}]}',
        ),
        ("invalid utf-8 everywhere", b"\xff\xfe\xfd\xfc" * 64),
        ("overlong utf-8 encoding", b'{"model": "\xc0\xaftiny-llama", "prompt": "x"}'),
        (
            "lone surrogate escape",
            (
                b'{"model": "tiny-llama", "prompt": "\\ud800", '
                b'"messages": [{"role": "user", "content": "\\udfff"}]}'
            ),
        ),
        ("utf-16 body", '{"model": "tiny-llama", "prompt": "x"}'.encode("utf-16")),
        ("nan", b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}'),
        ("infinity", b'{"model": "tiny-llama", "prompt": "x", "top_p": Infinity}'),
        (
            "integer past 64 bits",
            (
                b'{"model": "tiny-llama", "prompt": "x", '
                b'"max_tokens": 1000000000000000000000000000000}'
            ),
        ),
        (
            "deep nesting",
            b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ),
        ("trailing garbage", b'{"model": "tiny-llama", "prompt": "x"} {}'),
        ("nul bytes", b'{"model": "tiny-llama",\x00 "prompt": "x"}'),
    ],
)
def test_malformed_bodies_get_a_400(
    client: httpx.Client, route: str, name: str, body: bytes
) -> None:
    response = _post(client, route, body)
    assert_clean_error(response.status_code, response.content, statuses=(400,))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("max_tokens", 0, 400),
        ("max_tokens", -1, 400),
        ("max_tokens", -(2**63), 400),
        ("max_tokens", 2**31, 400),
        ("max_tokens", 2**63 - 1, 400),
        ("max_tokens", 1025, 400),
        ("max_tokens", 1.5, 400),
        ("max_tokens", "16", 400),
        ("max_tokens", True, 400),
        ("max_tokens", [16], 400),
        ("stream", "true", 400),
        ("stream", 1, 400),
        ("stream", 0, 400),
        ("stream", {}, 400),
        ("stream", [], 400),
        ("stream", "yes", 400),
        ("stream_options", {"include_usage": "yes"}, 400),
        ("stream_options", {"other": True}, 400),
        ("temperature", -0.1, 400),
        ("temperature", 2.5, 400),
        ("temperature", "hot", 400),
        ("top_p", 0, 400),
        ("top_p", 1.01, 400),
        ("n", 0, 400),
        ("stop", ["a", "b", "c", "d", "e"], 400),
        ("stop", 7, 400),
        ("stop", [None], 400),
        ("seed", "42", 400),
        ("seed", 1.5, 400),
        ("user", "u" * 257, 400),
        ("presence_penalty", 2.1, 400),
        ("frequency_penalty", -2.1, 400),
        ("model", "", 400),
        ("model", None, 400),
        ("model", 7, 400),
        ("model", ["tiny-llama"], 400),
        ("model", "no-such-model", 404),
        ("model", "tiny-llama\x00", 404),
        ("model", "../../etc/passwd", 404),
        ("model", "x" * 10_000, 404),
        ("rid", "gen_mine", 400),
        ("bootstrap_room", 1, 400),
        ("extra_key", "salt", 400),
        ("input_ids", [1], 400),
        ("unknown_field", 1, 400),
        ("logprobs", "yes", 400),
        ("top_logprobs", 21, 400),
        ("n", 17, 400),
        ("seed", 2**63, 400),
        ("top_k", 0, 400),
        ("min_p", 1.5, 400),
        ("repetition_penalty", 0, 400),
        ("logit_bias", {"not-a-token": 1}, 400),
        ("logit_bias", {"5": 101}, 400),
        ("tools", [], 400),
    ],
)
def test_out_of_range_and_wrongly_typed_fields_get_a_4xx(
    client: httpx.Client, route: str, field: str, value: Any, status: int
) -> None:
    response = _post(client, route, orjson.dumps(_valid_body(route, **{field: value})))
    error = assert_clean_error(response.status_code, response.content, statuses=(status,))
    if status == 400:
        assert error["param"] is None or error["param"].split(".")[0] in (
            field,
            "max_completion_tokens",
        ), error


@pytest.mark.parametrize(
    ("messages", "status", "code"),
    [
        ([], 400, "invalid_value"),
        (
            [{"role": "user", "content": "x"}] * 4097,
            400,
            "invalid_value",
        ),  # more messages than allowed
        # ~120,000 tokens in 2,048 messages, under the body limit: far over the pool, refused
        # before dispatch.
        ([{"role": "user", "content": "word " * 60}] * 2048, 400, "context_length_exceeded"),
        # A tool result must say which call it answers; the deprecated role is refused.
        ([{"role": "tool", "content": "x"}], 400, "invalid_value"),
        ([{"role": "function", "content": "x", "name": "f"}], 400, "unsupported_parameter"),
        # A documented part the model cannot take is refused for that reason.
        ([{"role": "user"}], 400, "missing_required_parameter"),
        ([{"role": "user", "content": None}], 400, "invalid_value"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
            400,
            "unsupported_parameter",
        ),
        ([{"role": "user", "content": "x", "tool_calls": []}], 400, "invalid_value"),
        (["just a string"], 400, "invalid_value"),
        ({"role": "user", "content": "x"}, 400, "invalid_value"),
    ],
)
def test_hostile_message_lists_get_a_400(
    client: httpx.Client, messages: Any, status: int, code: str
) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    response = _post(client, ROUTES[0], orjson.dumps(body))
    error = assert_clean_error(response.status_code, response.content, statuses=(status,))
    assert error["code"] == code, error


@pytest.mark.parametrize(
    "prompt",
    [
        [],
        [-1],
        [512],
        [2**31],
        [1.0],
        ["a"] * 65,  # more prompts than one request may carry
        [["a"]],
        {"text": "a"},
        None,
        7,
        [3] * 9000,  # token ids past the pool
        "word " * 50_000,  # text whose byte length alone proves it over the pool
    ],
)
def test_hostile_prompts_get_a_400(client: httpx.Client, prompt: Any) -> None:
    response = _post(client, ROUTES[1], orjson.dumps(_completion_body(prompt=prompt)))
    assert_clean_error(response.status_code, response.content, statuses=(400,))


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_over_the_limit_is_413_whether_declared_or_chunked(
    client: httpx.Client, route: str
) -> None:
    huge = b'{"model": "tiny-llama", "prompt": "' + b"a" * (FUZZ_MAX_BODY_BYTES + 1) + b'"}'
    declared = _post(client, route, huge)
    assert_clean_error(declared.status_code, declared.content, statuses=(413,))

    def chunks() -> Iterator[bytes]:  # no Content-Length: the gateway must count as it reads
        for start in range(0, len(huge), 65536):
            yield huge[start : start + 65536]

    FUZZ_CASES[f"hand-written POST {route}"] += 1
    chunked = client.post(route, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in chunked.request.headers
    assert_clean_error(chunked.status_code, chunked.content, statuses=(413,))


@pytest.mark.parametrize("content_length", ["-1", "abc", "99999999999999999999999"])
def test_a_lying_content_length_header_is_refused_without_a_crash(
    stack: StandInStack, client: httpx.Client, content_length: str
) -> None:
    # uvicorn itself refuses an unparsable Content-Length with a bare 400 before the app sees it;
    # what matters is no 5xx and a gateway that still serves afterwards.
    import socket

    request = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: {client.headers['authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n"
        "Connection: close\r\n\r\n{}"
    )
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
        sock.sendall(request.encode())
        answer = sock.recv(65536)
    FUZZ_CASES["hand-written raw HTTP"] += 1
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:300]
    assert client.post(ROUTES[1], json=_completion_body()).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_any_bytes_at_all_get_a_clean_4xx(client: httpx.Client, route: str) -> None:
    @FUZZ_SETTINGS
    @given(body=st.binary(max_size=2000))
    def check(body: bytes) -> None:
        response = _post(client, route, body)
        assert_clean_error(response.status_code, response.content, statuses=(400, 404))

    check()


@pytest.mark.parametrize("route", ROUTES)
def test_any_json_value_in_any_field_gets_a_clean_answer(client: httpx.Client, route: str) -> None:
    @FUZZ_SETTINGS
    @given(
        overrides=st.dictionaries(
            st.sampled_from(FIELDS) | st.text(max_size=12), json_values, min_size=1, max_size=4
        )
    )
    def check(overrides: dict[str, Any]) -> None:
        response = _post(client, route, orjson.dumps(_valid_body(route, **overrides)))
        assert_no_server_error(response.status_code, response.content)
        if response.status_code == 200 and "text/event-stream" not in response.headers.get(
            "content-type", ""
        ):
            assert response.json()["choices"], response.text

    check()


def test_the_gateway_survived_and_still_serves(stack: StandInStack, client: httpx.Client) -> None:
    assert stack.gateway.process is not None and stack.gateway.process.poll() is None
    for route in ROUTES:
        assert client.post(route, json=_valid_body(route)).status_code == 200
    assert "Traceback" not in stack.gateway.log_tail(size=10_000_000), (
        "an unhandled error was logged"
    )
