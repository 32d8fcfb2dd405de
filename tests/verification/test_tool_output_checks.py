"""Tool calls inside the checks, against a stand-in decode that writes what it is told to.

A canary marker the model wrote JSON-escaped inside a call's arguments is invisible to the scan
of the raw text; the scan of the arguments as handed out finds it, and the answer is withheld.
Under ``tool_choice`` required the engine promised a JSON array of calls: output that is not
one where the model stopped by itself is a failed check (502, or one error event in a stream),
never a 200 without calls.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from gateway.verification.scanner import CanaryScanner, new_marker
from tests.verification.stack import (
    MODEL,
    POOL_TOKENS,
    LyingStack,
    lying_stack,
    sse_events,
    wait_until,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
CANARY_KEY = "isogate-test-tools-canary-" + secrets.token_hex(6)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    env = {
        "ISOGATE_REDIS_URL": REDIS_URL,
        "ISOGATE_CANARY_REDIS_KEY": CANARY_KEY,
        "ISOGATE_CANARY_REFRESH_S": "0.1",
    }
    with lying_stack(
        tmp_path_factory.mktemp("tools"), env=env, tool_call_parser="qwen25"
    ) as running:
        yield running
    import redis

    redis.from_url(REDIS_URL).delete(CANARY_KEY)


@pytest.fixture(scope="module")
def key(stack: LyingStack) -> str:
    return stack.gateway.create_tenant()[1]


def _say(stack: LyingStack, *chunks: str) -> None:
    stack.decode.behaviour = replace(
        stack.decode.behaviour, text_chunks=chunks, pool_tokens=POOL_TOKENS, finish=None
    )


def _body(stream: bool, choice: Any = "auto") -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 8,
        "stream": stream,
    }


def _call(city: str) -> str:
    # json.dumps escapes non-ASCII: a marker in it is not in the raw text as written.
    arguments = json.dumps({"city": city})
    return '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"


def _assert_failed_check(response: httpx.Response, stream: bool) -> None:
    """Withheld: a 502, or (a stream that failed after its first step) one error event last."""
    if response.status_code == 502 or not stream:
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "isolation_check_failed"
        return
    events = sse_events(response)
    assert events[-1]["error"]["code"] == "isolation_check_failed"
    assert "[DONE]" not in response.text


def _publish_marker(stack: LyingStack) -> str:
    import redis.asyncio

    marker = new_marker()

    async def register() -> None:
        client = redis.asyncio.from_url(REDIS_URL)
        try:
            await CanaryScanner(client, CANARY_KEY).register_marker(
                marker, "tenant-b", 120, origin="test"
            )
        finally:
            await client.aclose()

    before = stack.metric("isogate_canary_live_markers")
    asyncio.run(register())
    assert wait_until(lambda: stack.metric("isogate_canary_live_markers") > before, timeout_s=10)
    return marker


def test_an_honest_call_is_parsed_into_tool_calls(stack: LyingStack, key: str) -> None:
    _say(stack, "Let me look.\n", _call("Paris")[:20], _call("Paris")[20:])
    with stack.client(key) as client:
        reply = client.post("/v1/chat/completions", json=_body(False)).json()
        streamed = sse_events(client.post("/v1/chat/completions", json=_body(True)))
    # Call markers may be special tokens: with tools offered the engine keeps them in the text.
    assert stack.decode.requests[-1]["sampling_params"]["skip_special_tokens"] is False
    message = reply["choices"][0]["message"]
    # The stand-in always reports finish "length": a cut-off answer keeps it (OpenAI's too).
    assert reply["choices"][0]["finish_reason"] == "length"
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    deltas = [e["choices"][0]["delta"] for e in streamed if isinstance(e, dict) and e["choices"]]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert "<tool_call>" not in "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_foreign_marker_escaped_in_call_arguments_is_withheld(
    stack: LyingStack, key: str, stream: bool
) -> None:
    marker = _publish_marker(stack)
    text = _call(marker)
    assert marker not in text  # the raw-text scan alone would pass it
    _say(stack, text)
    with stack.client(key) as client:
        response = client.post("/v1/chat/completions", json=_body(stream))
    _assert_failed_check(response, stream)
    assert marker not in response.text and "\\u27e6" not in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_output_that_is_not_the_promised_calls_fails_closed(
    stack: LyingStack, key: str, stream: bool
) -> None:
    # Unfinished where the model itself stopped (EOS), which the grammar allows only after a
    # complete array. (Cut short by max_tokens it is a normal finish: test_isolation_alarms.)
    _say(stack, '[{"name": "get_weather", "parameters": {"city": "Pa')
    stack.decode.behaviour = replace(stack.decode.behaviour, finish={"type": "stop", "matched": 1})
    with stack.client(key) as client:
        response = client.post("/v1/chat/completions", json=_body(stream, "required"))
    sent = stack.decode.requests[-1]
    assert "json_schema" in sent["sampling_params"]  # the constraint went to the engine
    _assert_failed_check(response, stream)
