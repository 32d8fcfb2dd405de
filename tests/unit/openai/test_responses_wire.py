"""The Responses API's wire format: the chat request a Responses request becomes, and the events
and objects it is answered with, held to the installed ``openai`` SDK's own types (every event
validated as the SDK's model of its type, and accumulated by the SDK's own stream state) and to
the gateway's answer models (strict)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.common.errors import APIError
from gateway.openai import protocol
from gateway.openai.protocol import TokenLogprob
from gateway.openai.responses import (
    ResponseEvents,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
    as_context,
    canonical_items,
    chat_messages,
    chat_request,
    input_item_page,
    output_items,
    response_object,
    text_logprob,
    usage_of,
)

SDK_EVENT = TypeAdapter(ResponseStreamEvent)
SDK_ITEM = TypeAdapter(ResponseItem)


def request(**fields: Any) -> ResponsesRequest:
    parsed: ResponsesRequest = protocol.parse_request(
        orjson.dumps({"model": "m", "input": "Hi", **fields}), ResponsesRequest
    )
    return parsed


def events_of(stream: bytes) -> list[dict[str, Any]]:
    """The payloads of an SSE body, each event's ``event:`` line checked against its type."""
    payloads = []
    for block in stream.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        payload = orjson.loads(data.removeprefix("data: "))
        assert name == "event: " + payload["type"]
        payloads.append(payload)
    return payloads


def through_the_sdk(payloads: list[dict[str, Any]]) -> ResponseStreamState[Any]:
    """Every payload validated as the SDK's event model and fed to the SDK's stream state (which
    raises on an event out of order, an unknown item, a changed identity)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for payload in payloads:
        event = SDK_EVENT.validate_python(payload)
        assert type(event).model_fields["type"].annotation.__args__ == (payload["type"],)
        state.handle_event(event)
    return state


def whole_stream(
    events: ResponseEvents, finish_reason: str = "stop"
) -> tuple[dict[str, Any], bytes]:
    out = events.created()
    out += events.reasoning("Let me think.")
    out += events.reasoning(" Done.")
    out += events.text("Hel", [TokenLogprob("Hel", -0.5, [("He", -1.5)])])
    out += events.text("lo", [TokenLogprob("lo", -0.25, [])])
    out += events.call("get_weather", '{"city": "Paris"}', "call_1")
    out += b"".join(events.closing(finish_reason))
    response, last = events.finished(finish_reason, usage_of(5, 7, 2), 1700000001)
    return written(response), out + last


def written(value: Any) -> Any:
    """``value`` as the client reads it (log probabilities are JSON written already)."""
    return orjson.loads(orjson.dumps(value))


def test_a_stream_is_the_sdks_events_in_order_numbered_from_zero() -> None:
    events = ResponseEvents(request(include=["message.output_text.logprobs"]), "gen_1", 1700000000)
    response, stream = whole_stream(events)
    payloads = events_of(stream)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["output_index"] for p in payloads if "output_index" in p] == [0] * 7 + [1] * 7 + [
        2
    ] * 4
    through_the_sdk(payloads)
    sdk_response = Response.model_validate(response)
    assert sdk_response.output_text == "Hello"
    assert payloads[-1]["response"] == response
    ResponseObject.model_validate(response)  # strict: no field missing or extra
    message = response["output"][1]
    assert [entry["token"] for entry in message["content"][0]["logprobs"]] == ["Hel", "lo"]
    assert payloads[11]["logprobs"] == [
        {"token": "Hel", "logprob": -0.5, "top_logprobs": [{"token": "He", "logprob": -1.5}]}
    ]


def test_a_streamed_response_ends_with_the_same_items_as_the_whole_answer() -> None:
    events = ResponseEvents(request(include=["message.output_text.logprobs"]), "gen_1", 1700000000)
    streamed, _ = whole_stream(events)
    whole = output_items(
        "Hello",
        "Let me think. Done.",
        [("call_1", "get_weather", '{"city": "Paris"}')],
        "completed",
        [
            text_logprob(TokenLogprob("Hel", -0.5, [("He", -1.5)])),
            text_logprob(TokenLogprob("lo", -0.25, [])),
        ],
    )

    def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert without_ids(streamed["output"]) == without_ids(whole)


def test_a_response_cut_at_max_output_tokens_is_incomplete_and_says_why() -> None:
    events = ResponseEvents(request(max_output_tokens=4), "gen_1", 1700000000)
    response, stream = whole_stream(events, finish_reason="length")
    payloads = events_of(stream)
    assert payloads[-1]["type"] == "response.incomplete"
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    through_the_sdk(payloads)
    ResponseObject.model_validate(response)


def test_an_empty_answer_is_still_one_message_as_the_whole_answer_has() -> None:
    events = ResponseEvents(request(), "gen_1", 1700000000)
    opened = events.created() + b"".join(events.closing("stop"))
    response, last = events.finished("stop", usage_of(5, 1, 0), 1700000001)
    payloads = events_of(opened + last)
    through_the_sdk(payloads)
    assert [item["type"] for item in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == ""
    assert [i["type"] for i in output_items("", None, [], "completed")] == ["message"]


def test_a_failure_mid_stream_ends_it_with_an_error_and_response_failed_and_nothing_more() -> None:
    events = ResponseEvents(request(), "gen_1", 1700000000)
    sent = events.created() + events.text("checked text")
    failure = APIError(
        502, "An isolation check failed.", "upstream_error", "isolation_check_failed"
    )
    payloads = events_of(sent + events.failed(failure))
    assert [p["type"] for p in payloads[-2:]] == ["error", "response.failed"]
    assert payloads[-2]["code"] == "isolation_check_failed"
    failed = payloads[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    # What was sent of the open message, and nothing else, marked incomplete.
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "checked text"
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    through_the_sdk(payloads)
    ResponseObject.model_validate(failed)


def test_the_response_object_is_the_sdks_and_echoes_the_request() -> None:
    parsed = request(
        instructions="Be terse.",
        temperature=0.2,
        metadata={"k": "v"},
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        store=False,
        previous_response_id="gen_0",
    )
    output = output_items("", None, [("call_1", "f", "{}")], "completed")
    response = response_object(
        parsed,
        id="gen_1",
        created_at=1,
        status="completed",
        output=output,
        usage=usage_of(10, 3, 4),
        completed_at=2,
    )
    ResponseObject.model_validate(response)
    sdk = Response.model_validate(response)
    assert sdk.instructions == "Be terse." and sdk.store is False
    assert sdk.previous_response_id == "gen_0" and sdk.metadata == {"k": "v"}
    assert sdk.tool_choice.type == "function"  # type: ignore[union-attr]
    assert sdk.usage is not None and sdk.usage.input_tokens_details.cached_tokens == 4
    assert [item.type for item in sdk.output] == ["function_call"]  # calls only: no message


def test_input_items_are_the_sdks_items_and_page_as_openai_pages_them() -> None:
    parsed = request(
        input=[
            {"role": "user", "content": "What is the weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        ]
    )
    items = canonical_items(parsed)
    for item in items:
        SDK_ITEM.validate_python(item)
    newest_first = input_item_page(items, after=None, limit=2, order="desc")
    ResponseItemList.model_validate(newest_first)
    assert [i["type"] for i in newest_first["data"]] == ["message", "function_call_output"]
    assert newest_first["has_more"] is True
    rest = input_item_page(items, after=newest_first["last_id"], limit=2, order="desc")
    assert [i["type"] for i in rest["data"]] == ["function_call", "message"]
    assert rest["has_more"] is False
    oldest = input_item_page(items, after=None, limit=100, order="asc")
    assert oldest["data"] == items and oldest["first_id"] == items[0]["id"]


def test_the_chat_request_is_the_conversation_a_chat_client_would_send() -> None:
    """Instructions first, then the stored conversation, then this input: the same messages
    as the chat request that says the same, and the same sampling and output settings."""
    earlier = request(input="What is the weather in Paris?")
    context = [
        *canonical_items(earlier),
        *output_items("", None, [("c1", "get_weather", '{"city": "Paris"}')], "completed"),
    ]
    follow_up = request(
        input=[{"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        instructions="Be terse.",
        max_output_tokens=12,
        temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        text={"format": {"type": "json_object"}},
    )
    served = chat_request(follow_up, context, canonical_items(follow_up))
    chat = protocol.parse_request(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "What is the weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {
                                    "name": "get_weather",
                                    "arguments": '{"city": "Paris"}',
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
                "max_completion_tokens": 12,
                "temperature": 0,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "parameters": {"type": "object"}},
                    }
                ],
                "response_format": {"type": "json_object"},
            }
        ),
        protocol.ChatCompletionRequest,
    )
    assert [(m.role, m.text(), m.template_fields()) for m in served.messages] == [
        (m.role, m.text(), m.template_fields()) for m in chat.messages
    ]
    assert served.sampling_params(12) == chat.sampling_params(12)
    assert served.tools == chat.tools and served.requested_max_tokens == 12


def test_an_answer_with_text_and_calls_sends_the_calls_back_on_that_assistant_turn() -> None:
    context = output_items(
        "Let me look.", None, [("c1", "f", "{}"), ("c2", "g", "{}")], "completed"
    )
    follow_up = request(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"}])
    messages = chat_request(follow_up, context, canonical_items(follow_up)).messages
    assert [m.role for m in messages] == ["assistant", "tool"]
    assert messages[0].text() == "Let me look."
    assert [c.id for c in messages[0].tool_calls or ()] == ["c1", "c2"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to require
        ({"top_k": 0}, "top_k"),
    ],
)
def test_the_chat_requests_own_checks_still_apply(fields: dict[str, Any], param: str) -> None:
    parsed = request(**fields)
    with pytest.raises(APIError) as refused:
        chat_request(parsed, [], canonical_items(parsed))
    assert refused.value.status == 400 and refused.value.param == param


def test_a_later_turns_context_keeps_the_answer_and_drops_its_log_probabilities() -> None:
    events = ResponseEvents(request(include=["message.output_text.logprobs"]), "gen_1", 1700000000)
    response, _ = whole_stream(events)
    output = response["output"]
    assert output[1]["content"][0]["logprobs"]  # the answer has them...
    context = as_context(output)
    assert context[1]["content"][0]["logprobs"] == []  # ...its context does not
    assert chat_messages(context) == chat_messages(output)
    assert [item["type"] for item in context] == [item["type"] for item in output]
