"""Every field of the OpenAI SDK's ``ResponseCreateParams`` is honoured, accepted without effect
for a documented reason, or refused with a 400 that says why.

The test walks the ``openai`` package's own TypedDict behind ``responses.create``: a field that a
new SDK adds has no sample below and fails here until someone decides what the gateway does
with it. No documented field is ever answered "unknown parameter", and an explicit ``null`` for
any of them means "not given".
"""

from __future__ import annotations

import typing
from typing import Any

import orjson
import pytest
from openai.types.responses import response_create_params

from gateway.common.errors import APIError
from gateway.openai import protocol
from gateway.openai.responses import ResponsesRequest, canonical_items, chat_request

REQUIRED = {"model": "m", "input": "Hi"}
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]

# A typical value a client sends for each field (beside the required ones).
SAMPLES: dict[str, Any] = {
    "access_programs": {"cyber": "standard"},
    "background": True,
    "background_options": {"completion_window": "2h"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_123",
    "image": {"context_compression": "auto"},
    "include": ["message.output_text.logprobs"],
    "instructions": "Be terse.",
    "max_output_tokens": 16,
    "max_tool_calls": 3,
    "metadata": {"k": "v"},
    "moderation": {"model": "omni-moderation-latest"},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_123",
    "prompt": {"id": "pmpt_123", "variables": {"x": "y"}},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "u-1",
    "service_tier": "auto",
    "store": False,
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.5,
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "tool_choice": "required",
    "tools": TOOLS,
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "u-1",
}
# Fields that take effect only beside another.
WITH = {
    "tool_choice": {"tools": TOOLS},
    "top_logprobs": {"include": ["message.output_text.logprobs"]},
}
# The fields honoured: each changes the chat request the core serves (the rest are refused,
# or accepted without effect for the reason ``ignored_fields`` gives).
HONOURED = {
    "include",
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "reasoning",
    "stream",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
}
# Honoured beyond the chat request: the conversation chained, what is stored; the one
# service tier there is (the answer says "default"); the stream options (their one field,
# obfuscation, is ``Ignored`` for its reason).
HONOURED_ELSEWHERE = {"previous_response_id", "store", "service_tier", "stream_options"}


def sdk_fields() -> set[str]:
    return set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}


def outcome(body: dict[str, Any]) -> APIError | ResponsesRequest:
    try:
        parsed: ResponsesRequest = protocol.parse_request(orjson.dumps(body), ResponsesRequest)
    except APIError as error:
        return error
    return parsed


def test_every_sdk_field_has_a_sample_and_so_a_decision() -> None:
    undecided = sdk_fields() - set(SAMPLES) - set(REQUIRED)
    assert not undecided, f"new SDK fields, honour or refuse them with a reason: {undecided}"


@pytest.mark.parametrize("field", sorted(set(SAMPLES)))
def test_each_field_is_honoured_ignored_for_a_reason_or_refused_for_one(field: str) -> None:
    result = outcome({**REQUIRED, **WITH.get(field, {}), field: SAMPLES[field]})
    if isinstance(result, APIError):
        # Refused for a reason that names the field, never as unknown or malformed.
        assert result.code == "unsupported_parameter", (field, result.message)
        assert result.param is not None and field in result.param, (field, result.param)
        assert "not supported by this gateway:" in result.message, result.message
        assert field not in HONOURED | HONOURED_ELSEWHERE
        return
    ignored = protocol.ignored_fields(ResponsesRequest)
    if field in HONOURED:
        plain = chat_request(*parsed_parts(outcome({**REQUIRED, **WITH.get(field, {})})))
        honoured = chat_request(*parsed_parts(result))
        assert honoured != plain, f"{field} is accepted but changes nothing the core serves"
    else:
        assert field in ignored or field in HONOURED_ELSEWHERE, (
            f"{field} is accepted without a decision: honour it, mark it Ignored(reason), "
            "or refuse it"
        )


def parsed_parts(parsed: Any) -> tuple[ResponsesRequest, list[Any], list[Any]]:
    assert isinstance(parsed, ResponsesRequest), parsed
    return parsed, [], canonical_items(parsed)


def test_every_ignored_field_says_why() -> None:
    ignored = protocol.ignored_fields(ResponsesRequest)
    assert ignored, "the decisions are listed"
    assert all(len(reason) > 20 for reason in ignored.values()), ignored


def test_an_explicit_null_means_not_given() -> None:
    nulls = {field: None for field in sdk_fields() - set(REQUIRED)}
    assert not isinstance(outcome({**REQUIRED, **nulls}), APIError)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools", "built-in"),
        ({"truncation": "auto"}, "truncation", "never truncated"),
        ({"background": True}, "background", "no background queue"),
        ({"conversation": {"id": "conv_1"}}, "conversation", "previous_response_id"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "never handed out encrypted"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "not resolved"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "text only",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_that_says_so(
    fields: dict[str, Any], param: str, says: str
) -> None:
    result = outcome({**REQUIRED, **fields})
    assert isinstance(result, APIError) and result.status == 400
    assert result.code == "unsupported_parameter", result.message
    assert result.param is not None and result.param.startswith(param), result.param
    assert says in result.message, result.message


def test_a_field_that_steers_isolation_is_refused_as_on_chat() -> None:
    for field in ("request_id", "extra_key", "cache_salt", "session_id", "priority"):
        result = outcome({**REQUIRED, field: "x" if field != "priority" else 1})
        assert isinstance(result, APIError) and result.code == "reserved_parameter", field


def test_numeric_fields_are_bounded_by_the_engine_bounds_table() -> None:
    for field, value in (
        ("max_output_tokens", 2**31),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_logprobs", 21),
        ("top_k", 2**31),
        ("seed", 2**63),
    ):
        result = outcome({**REQUIRED, field: value})
        assert isinstance(result, APIError) and result.param == field, (field, result)
