"""Every field of the OpenAI SDK's request types is honoured or refused with a reason.

The test walks the ``openai`` package's own TypedDicts behind ``chat.completions.create`` and
``completions.create``: a field that a new SDK adds has no sample below and fails here, until
someone decides whether the gateway honours it. No documented field may ever be answered
"unknown parameter", and an explicit ``null`` for any of them means "not given".
"""

from __future__ import annotations

import typing
from typing import Any

import orjson
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from gateway.common.errors import APIError
from gateway.openai import protocol

MESSAGES = [{"role": "user", "content": "Hi"}]

# A typical value a client sends for each field (beside the required ones).
CHAT_SAMPLES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"5": 1.0},
    "logprobs": True,
    "max_completion_tokens": 8,
    "max_tokens": 8,
    "metadata": {"k": "v"},
    "modalities": ["text"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "u-1",
    "seed": 7,
    "service_tier": "auto",
    "stop": ["\n"],
    "store": False,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u-1",
    "verbosity": "low",
    "web_search_options": {},
}
COMPLETION_SAMPLES: dict[str, Any] = {
    "best_of": 1,
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "logprobs": 2,
    "max_tokens": 8,
    "n": 2,
    "presence_penalty": 0.5,
    "seed": 7,
    "stop": "\n",
    "stream": True,
    "stream_options": {"include_usage": True},
    "suffix": "end",
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u-1",
}
# Fields that OpenAI takes only beside another.
WITH = {
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": CHAT_SAMPLES["tools"]},
}
CHAT_REQUIRED = {"messages": MESSAGES, "model": "m"}
COMPLETION_REQUIRED = {"prompt": "Hi", "model": "m"}


def sdk_fields(params: Any) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


CASES = [
    (protocol.ChatCompletionRequest, CHAT_REQUIRED, CHAT_SAMPLES, chat_params),
    (protocol.CompletionRequest, COMPLETION_REQUIRED, COMPLETION_SAMPLES, completion_params),
]


def outcome(schema: type[protocol._Request], body: dict[str, Any]) -> APIError | None:
    try:
        protocol.parse_request(orjson.dumps(body), schema)
    except APIError as error:
        return error
    return None


@pytest.mark.parametrize(("schema", "required", "samples", "params"), CASES)
def test_every_sdk_field_has_a_decision(
    schema: type[protocol._Request], required: dict[str, Any], samples: dict[str, Any], params: Any
) -> None:
    undecided = sdk_fields(params) - set(samples) - set(required)
    assert not undecided, f"new SDK fields, honour or refuse them with a reason: {undecided}"


@pytest.mark.parametrize(("schema", "required", "samples", "params"), CASES)
def test_no_sdk_field_is_an_unknown_parameter(
    schema: type[protocol._Request], required: dict[str, Any], samples: dict[str, Any], params: Any
) -> None:
    for field in sorted(sdk_fields(params) - set(required)):
        error = outcome(schema, {**required, **WITH.get(field, {}), field: samples[field]})
        if error is not None:
            # Refused for a reason that names the field, never as unknown or malformed.
            assert error.code == "unsupported_parameter", (field, error.message)
            assert error.param is not None and field in error.param, (field, error.param)
            assert "not supported by this gateway:" in error.message, error.message


@pytest.mark.parametrize(("schema", "required", "samples", "params"), CASES)
def test_an_explicit_null_means_not_given(
    schema: type[protocol._Request], required: dict[str, Any], samples: dict[str, Any], params: Any
) -> None:
    nulls = {field: None for field in sdk_fields(params) - set(required)}
    assert outcome(schema, {**required, **nulls}) is None


@pytest.mark.parametrize("schema", [protocol.ChatCompletionRequest, protocol.CompletionRequest])
def test_a_sampling_field_reaches_the_engine_only_when_the_client_sent_a_value(
    schema: type[protocol._Request],
) -> None:
    # ``sampling_params`` looks only at the fields a client sent: every default must be None.
    required = (
        CHAT_REQUIRED
        if schema is protocol.ChatCompletionRequest
        else {
            "model": "m",
            "prompt": "hi",
        }
    )
    for field, _ in protocol._SAMPLING_FIELDS:
        assert schema.model_fields[field].default is None, field
    unset = schema.model_validate(required)
    nulls = schema.model_validate({**required, **{f: None for f, _ in protocol._SAMPLING_FIELDS}})
    assert unset.sampling_params(8) == nulls.sampling_params(8) == {"max_new_tokens": 8}


def test_the_honoured_fields_reach_the_engine_as_sglang_takes_them() -> None:
    parsed = protocol.parse_request(
        orjson.dumps(
            {
                **CHAT_REQUIRED,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 7,
                "stop": ["\n"],
                "logit_bias": {"5": 1.0},
                "response_format": {"type": "json_object"},
                "top_k": 5,
                "min_p": 0.1,
                "min_tokens": 1,  # above 1, not with a constraint (response_format)
                "repetition_penalty": 1.1,
                "ignore_eos": True,
                "stop_token_ids": [3],
                "skip_special_tokens": False,
                "no_stop_trim": True,
            }
        ),
        protocol.ChatCompletionRequest,
    )
    assert parsed.sampling_params(8) == {
        "max_new_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_new_tokens": 1,
        "stop": ["\n"],
        "stop_token_ids": [3],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 7,
        "logit_bias": {"5": 1.0},
        "json_schema": '{"type":"object"}',
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"regex": "[a-z]+", "ebnf": 'root ::= "a"'}, "regex"),
        (
            {"response_format": {"type": "json_object"}, "json_schema": '{"type": "object"}'},
            "json_schema",
        ),
    ],
)
def test_two_grammars_at_once_are_refused(fields: dict[str, Any], param: str) -> None:
    parsed = protocol.parse_request(
        orjson.dumps({**CHAT_REQUIRED, **fields}), protocol.ChatCompletionRequest
    )
    with pytest.raises(APIError) as refused:
        parsed.sampling_params(8)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(
    "schema",
    [{"type": "nope"}, {"properties": 3}, {"required": "name"}],
)
def test_a_json_schema_the_engine_could_not_compile_is_a_400(schema: dict[str, Any]) -> None:
    body = {
        **CHAT_REQUIRED,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    error = outcome(protocol.ChatCompletionRequest, body)
    assert error is not None and error.status == 400 and error.code == "invalid_value"
    assert error.param == "response_format.json_schema.schema"


def test_token_ids_outside_the_vocabulary_are_refused_before_the_engine() -> None:
    parsed = protocol.parse_request(
        orjson.dumps({**CHAT_REQUIRED, "logit_bias": {"600": 1.0}}), protocol.ChatCompletionRequest
    )
    with pytest.raises(APIError) as refused:
        parsed.check_against(vocab_size=512, max_tokens=8)
    assert refused.value.param == "logit_bias"


def test_text_parts_are_joined_as_sglang_joins_them() -> None:
    parsed = protocol.parse_request(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            }
        ),
        protocol.ChatCompletionRequest,
    )
    assert parsed.messages[0].text() == "a b"
