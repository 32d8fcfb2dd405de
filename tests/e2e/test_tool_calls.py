"""Tool calling end to end: the openai SDK → gateway → the real SGLang PD pair (CPU).

The dev model's weights are random, so what it writes is only a call where constrained
decoding makes it one: ``tool_choice`` required or named must come back as parsed calls whose
arguments validate against the function's schema, streamed or not. A conversation that sends a
call's result back renders through the template and is served; a model whose policy names no
tool-call parser refuses tools.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL, PLAIN_MODEL

pytestmark = pytest.mark.engine

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess, tenant: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=tenant[1], max_retries=0, timeout=120
    )


def _valid_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_choice_gives_parsed_calls_whose_arguments_fit_the_schema(
    client: openai.OpenAI, choice: Any
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls"
    calls = choice_.message.tool_calls or []
    assert len(calls) == 1
    assert choice_.message.content is None
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _valid_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"


def test_streamed_forced_call_sends_id_and_name_first_then_the_arguments(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [piece for delta in deltas for piece in delta.tool_calls or []]
    assert pieces, "no tool-call deltas"
    assert pieces[0].id and pieces[0].id.startswith("call_")
    assert pieces[0].function is not None and pieces[0].function.name == "get_weather"
    assert all(piece.index == 0 for piece in pieces)
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    _valid_call("get_weather", arguments)
    assert not "".join(d.content or "" for d in deltas).strip()  # no raw output as content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["tool_calls"]


def test_a_conversation_sending_the_tool_result_back_is_served(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'},
    ]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, stream=True
                )
            )
            finals = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finals[-1] in ("stop", "length", "tool_calls")
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, max_tokens=8
            )
            assert reply.usage is not None
            # The tool turn reached the prompt: it is longer than the first request's.
            assert first.usage is not None
            assert reply.usage.prompt_tokens > first.usage.prompt_tokens
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tools_on_a_model_without_a_tool_call_parser_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=PLAIN_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4
        )
    assert raised.value.status_code == 400
    body: Any = raised.value.body
    assert body["param"] == "tools" and "tool_call_parser" in body["message"]
    # The same model without tools is served.
    reply = client.chat.completions.create(model=PLAIN_MODEL, messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_by_max_tokens_is_answered_200_with_finish_reason_length(
    client: openai.OpenAI, stream: bool
) -> None:
    """A call that max_tokens cuts short is an ordinary length finish, as OpenAI answers one;
    it was a 502 isolation_check_failed ("the calls' JSON array is not complete valid JSON"),
    which SDKs retry and operators learn to ignore. The unfinished call comes back as text."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 5,  # inside the first call's arguments
        "temperature": 0,
    }
    if not stream:
        reply = client.chat.completions.create(**fields)
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.tool_calls
        text = choice.message.content or ""
    else:
        chunks = list(client.chat.completions.create(**fields, stream=True))
        choices = [c.choices[0] for c in chunks if c.choices]
        assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
        assert not any(c.delta.tool_calls for c in choices)
        text = "".join(c.delta.content or "" for c in choices)
    assert text.startswith("[")  # the call array as the model began it
    with pytest.raises(ValueError):
        json.loads(text)  # an unfinished call, as text
