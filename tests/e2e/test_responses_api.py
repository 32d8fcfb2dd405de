"""The Responses API end to end: the official OpenAI SDK (``client.responses``) → gateway → the
real SGLang PD pair (CPU).

The dev model's weights are random, so what is checked of an answer is what the gateway makes
of it: the same greedy text as chat completions for the same conversation, JSON that follows
its schema (constrained decoding), a forced call whose arguments fit its function, events in
the order the SDK's own stream state accepts, and the stored response read back, continued,
listed and deleted.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL

pytestmark = pytest.mark.engine

INSTRUCTIONS = "You are terse."
QUESTION = "Say hello to the world."
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
]


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess, tenant: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=tenant[1], max_retries=0, timeout=120
    )


def test_a_response_is_the_same_greedy_text_as_the_chat_completion(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("gen_")
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text  # the model said something
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == expected
    assert response._request_id == response.id  # the x-request-id header, the audit key


def test_json_schema_output_follows_the_schema(client: openai.OpenAI) -> None:
    # The dev model's weights favour closing a structure (gateway/dev/model.py), so the output
    # is complete within a small max_output_tokens, not cut off.
    response = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_a_forced_call_and_its_output_sent_back_with_previous_response_id(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The whole conversation was admitted and counted: the first turn, its call, the output.
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id)
    assert [(i.type, getattr(i, "call_id", None)) for i in items.data] == [
        ("function_call_output", call.call_id)
    ]


def test_a_stream_is_the_sdks_event_sequence_and_its_final_response_is_stored(
    client: openai.OpenAI,
) -> None:
    with client.responses.stream(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=10, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == last.output_text
    whole = client.responses.create(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=10, temperature=0
    )
    assert last.output_text == whole.output_text
    if final is not None:
        assert final.output_text == last.output_text
    stored = client.responses.retrieve(last.id)
    assert stored.output_text == last.output_text and stored.status == last.status


def test_retrieve_input_items_and_delete(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=4,
        metadata={"ticket": "t-1"},
    )
    stored = client.responses.retrieve(created.id)
    assert stored.model_dump() == created.model_dump()
    items = client.responses.input_items.list(created.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [  # type: ignore[union-attr]
        ("message", "developer"),
        ("message", "user"),
    ]
    assert items.data[1].content[0].text == QUESTION  # type: ignore[union-attr]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, input="Go on.", previous_response_id=created.id, max_output_tokens=4
        )


def test_store_false_answers_and_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=4, store=False
    )
    assert response.store is False and response.output_text is not None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_what_cannot_be_honoured_is_refused_with_a_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input=QUESTION, tools=[{"type": "web_search"}], max_output_tokens=4
        )
    assert "built-in tools" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=QUESTION, background=True)
    assert "background" in str(refused.value)
