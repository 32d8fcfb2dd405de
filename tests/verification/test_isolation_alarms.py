"""The isolation alarm (502 ``isolation_check_failed``, or one error event in a stream) fires on
what a well-behaved engine cannot produce, and never on what it can.

Every path that raises ``IsolationFailure`` in the gateway, and whether an honest engine can
reach it:

- ``check_meta`` (another request's tags or IDs, a miscounted prompt, more tokens than asked,
  log probabilities that are not this answer's): never; ``test_lying_worker`` shows each lie
  withheld, ``test_honest_path`` the honest answers served.
- ``check_prompt_logprobs`` (prefill scored another sequence): never; ``test_choices_and_logprobs``.
- ``StreamGuard`` (stream text rewritten): never, SGLang's stream text only grows;
  ``tests/unit/api/test_stream_batches``.
- the canary scan (another tenant's marker in the output): never; ``test_lying_worker`` and
  ``test_tool_output_checks``.
- an abort: only the engine's own isolation refusal (engine_patch) is the alarm. An abort it
  was asked for is a normal finish ("abort", as SGLang's server reports it); an engine error
  streamed as an abort is that error (502/503/400), not an isolation alarm. Here.
- constrained tool calls (``tool_choice`` required or named) that break their schema: only at
  the output's own end; cut short by the client's limit (``max_tokens``, a stop sequence or stop
  token id) it is an ordinary finish with its reason, the unfinished call coming back as text.
  Here.

Every answer, alarm or not, carries its generation ID as ``x-request-id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.standin_worker import Behaviour
from tests.verification.stack import MODEL, POOL_TOKENS, LyingStack, lying_stack, sse_events

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CUT_CALL = '[{"name": "get_weather", "parameters": {"city": "Pa'
EOS = {"type": "stop", "matched": 1}  # the model's own end: the only stop a grammar allows
ASKED_ABORT = {"type": "abort", "message": "Abort in waiting queue", "status_code": None}
ENGINE_ERROR = {"type": "abort", "message": "Grammar accept_token failed", "status_code": 500}
ENGINE_REFUSAL = {
    "type": "abort",
    "message": "isolation check failed (coverage): pages [0,16) reserved, [0,8) attested",
    "status_code": 500,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    with lying_stack(tmp_path_factory.mktemp("alarms"), tool_call_parser="qwen25") as running:
        yield running


@pytest.fixture(scope="module")
def key(stack: LyingStack) -> str:
    return stack.gateway.create_tenant()[1]


def behave(stack: LyingStack, *chunks: str, finish: dict[str, Any] | None = None) -> None:
    stack.decode.behaviour = replace(
        Behaviour(pool_tokens=POOL_TOKENS), text_chunks=chunks, finish=finish
    )


def ask(stack: LyingStack, key: str, stream: bool, **fields: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 8,
        "stream": stream,
        **fields,
    }
    with stack.client(key) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.headers["x-request-id"] == response.headers["x-generation-id"]
    return response


def answered(response: httpx.Response, stream: bool) -> tuple[str, str, list[Any]]:
    """A served answer's content, finish reason and tool calls, whole or streamed."""
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        message = choice["message"]
        return message["content"] or "", choice["finish_reason"], message.get("tool_calls") or []
    events = sse_events(response)
    assert events[-1] == "[DONE]", events[-1]
    assert not any("error" in e for e in events[:-1])
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    return content, choices[-1]["finish_reason"], calls


def alarm(response: httpx.Response, stream: bool) -> str:
    """The alarm's message: a 502, or a stream's one error event last (no [DONE])."""
    if response.status_code == 502 or not stream:
        assert response.status_code == 502
        error = response.json()["error"]
    else:
        events = sse_events(response)
        assert "[DONE]" not in events
        error = events[-1]["error"]
    assert error["code"] == "isolation_check_failed", error
    return str(error["message"])


def forced(**fields: Any) -> dict[str, Any]:
    return {"tools": TOOLS, "tool_choice": "required", **fields}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("finish", "fields", "finish_reason"),
    [
        (None, {}, "length"),  # max_tokens
        ({"type": "stop", "matched": "Pa"}, {"stop": ["Pa"]}, "stop"),  # the client's stop
        ({"type": "stop", "matched": 7}, {"stop_token_ids": [7]}, "stop"),  # its stop id
        (ASKED_ABORT, {}, "abort"),
    ],
    ids=["max_tokens", "stop string", "stop token id", "asked-for abort"],
)
def test_a_forced_call_cut_short_by_a_limit_is_answered_with_its_finish_reason(
    stack: LyingStack,
    key: str,
    stream: bool,
    finish: dict[str, Any] | None,
    fields: dict[str, Any],
    finish_reason: str,
) -> None:
    behave(stack, CUT_CALL[:12], CUT_CALL[12:], finish=finish)
    response = ask(stack, key, stream, **forced(**fields))
    assert "json_schema" in stack.decode.requests[-1]["sampling_params"]  # it was constrained
    content, reason, calls = answered(response, stream)
    assert reason == finish_reason
    assert content == CUT_CALL and calls == []  # the unfinished call, as text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_complete_calls_before_the_cut_are_calls(stack: LyingStack, key: str, stream: bool) -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    behave(stack, "[" + one, ", " + '{"name": "get_w')
    content, reason, calls = answered(ask(stack, key, stream, **forced()), stream)
    assert reason == "length" and content == '{"name": "get_w'
    # (Streamed, a call's first delta names it; its arguments follow.)
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "chunks",
    [(CUT_CALL[:12], CUT_CALL[12:]), ("The weather", " is fine."), ("[]",)],
    ids=["unfinished", "not calls", "no call"],
)
def test_a_forced_call_broken_at_the_outputs_own_end_is_the_alarm(
    stack: LyingStack, key: str, stream: bool, chunks: tuple[str, ...]
) -> None:
    behave(stack, *chunks, finish=EOS)
    assert "constraint" in alarm(ask(stack, key, stream, **forced()), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_unforced_call_cut_by_max_tokens_is_answered_200_length(
    stack: LyingStack, key: str, stream: bool
) -> None:
    behave(stack, "Let me check.\n<tool_call>\n", '{"name": "get_weather", "arguments": {"ci')
    content, reason, calls = answered(ask(stack, key, stream, tools=TOOLS), stream)
    assert reason == "length" and calls == []
    assert content.startswith("Let me check.")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_abort_the_engine_was_asked_for_is_a_normal_finish(
    stack: LyingStack, key: str, stream: bool
) -> None:
    behave(stack, "Hello", " world", finish=ASKED_ABORT)
    content, reason, _ = answered(ask(stack, key, stream), stream)
    assert (content, reason) == ("Hello world", "abort")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_error_streamed_as_an_abort_is_that_error_not_the_alarm(
    stack: LyingStack, key: str, stream: bool
) -> None:
    behave(stack, "Hello", " world", finish=ENGINE_ERROR)
    failures = stack.metric("isogate_verification_failures_total")
    response = ask(stack, key, stream)
    if stream:
        assert response.status_code == 200  # the first chunk went out before the abort
        error = sse_events(response)[-1]["error"]
    else:
        assert response.status_code == 502
        error = response.json()["error"]
    assert error["code"] == "upstream_error" and "Grammar" not in error["message"]
    assert stack.metric("isogate_verification_failures_total") == failures


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_engines_own_isolation_refusal_is_the_alarm(
    stack: LyingStack, key: str, stream: bool
) -> None:
    behave(stack, "Hello", " world", finish=ENGINE_REFUSAL)
    message = alarm(ask(stack, key, stream), stream)
    assert "isolation check refused" in message and "coverage" not in message


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    stack: LyingStack, key: str
) -> None:
    behave(stack, "Hello", " world", "!")
    response = ask(
        stack, key, True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    events = sse_events(response)[:-1]
    chunks = [e for e in events if e["choices"]]
    assert all("usage" in e for e in chunks)
    assert [e["usage"]["completion_tokens"] for e in chunks][-1] == 3
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_a_refused_key_is_answered_with_a_request_id_and_no_generation_id(
    stack: LyingStack,
) -> None:
    with stack.client("sk-iso-not-a-key") as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL})
    assert response.status_code == 401
    assert response.headers["x-request-id"].startswith("gen_")
    assert "x-generation-id" not in response.headers  # no audit event to find
