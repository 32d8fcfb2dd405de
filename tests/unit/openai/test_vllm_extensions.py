"""vLLM's extension fields, as clients written for vLLM send them, each with its decision.

vLLM is not installed here, so its fields are listed (those of its OpenAI server's chat and
completion requests beyond OpenAI's): each is honoured as SGLang honours the same setting,
accepted and ignored for a documented reason, or refused with a 400 saying why; vLLM's own
default is accepted wherever it asks for nothing. SGLang's own fields are walked from the
installed package by ``tests/engine_parity/test_sglang_request_surface.py``.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.common.errors import APIError
from gateway.openai import protocol
from tests.request_surface import (
    CHAT,
    CHAT_REQUIRED,
    COMPLETION,
    COMPLETION_REQUIRED,
    HONOURED,
    IGNORED,
    REFUSED,
    Decision,
    decision,
    parse,
)

# Field: (a value a client sends, the decision, vLLM's default where it has one).
SHARED: dict[str, tuple[Any, Decision, Any]] = {
    "use_beam_search": (True, REFUSED, False),
    "top_k": (5, HONOURED, None),
    "min_p": (0.1, HONOURED, None),
    "repetition_penalty": (1.1, HONOURED, None),
    "length_penalty": (0.8, IGNORED, 1.0),
    "stop_token_ids": ([3], HONOURED, None),
    "include_stop_str_in_output": (True, HONOURED, False),
    "ignore_eos": (True, HONOURED, False),
    "min_tokens": (2, HONOURED, 0),
    "skip_special_tokens": (False, HONOURED, True),
    "spaces_between_special_tokens": (False, HONOURED, True),
    "truncate_prompt_tokens": (100, REFUSED, None),
    "prompt_logprobs": (1, REFUSED, None),
    "allowed_token_ids": ([1, 2], REFUSED, None),
    "bad_words": (["x"], REFUSED, None),
    "response_format": ({"type": "json_object"}, HONOURED, None),
    "guided_json": ({"type": "object"}, HONOURED, None),
    "guided_regex": ("[a-z]+", HONOURED, None),
    "guided_choice": (["yes", "no"], HONOURED, None),
    "guided_grammar": ('root ::= "a"', HONOURED, None),
    "guided_decoding_backend": ("xgrammar", IGNORED, None),
    "guided_whitespace_pattern": (" ", REFUSED, None),
    "structured_outputs": ({"regex": "a+"}, REFUSED, None),
    "priority": (1, REFUSED, None),
    "request_id": ("mine", REFUSED, None),
    "logits_processors": (["pkg.Processor"], REFUSED, None),
    "return_tokens_as_token_ids": (True, REFUSED, False),
    "return_token_ids": (True, REFUSED, False),
    "cache_salt": ("salt", REFUSED, None),
    "kv_transfer_params": ({"do_remote_decode": True}, REFUSED, None),
    "vllm_xargs": ({"k": 1}, REFUSED, None),
    "mm_processor_kwargs": ({"k": 1}, REFUSED, None),
}
CHAT_ONLY: dict[str, tuple[Any, Decision, Any]] = {
    "echo": (True, REFUSED, False),
    "add_generation_prompt": (False, HONOURED, True),
    "continue_final_message": (True, HONOURED, False),
    "add_special_tokens": (True, REFUSED, False),
    "documents": ([{"title": "t", "text": "x"}], REFUSED, None),
    "chat_template": ("{{ messages }}", REFUSED, None),
    "chat_template_kwargs": ({"enable_thinking": False}, HONOURED, None),
}
COMPLETION_ONLY: dict[str, tuple[Any, Decision, Any]] = {
    "add_special_tokens": (False, REFUSED, True),
    "prompt_embeds": ("base64", REFUSED, None),
}
CASES = [
    pytest.param(schema, required, field, sample, id=f"{schema.__name__}-{field}")
    for schema, required, table in (
        (CHAT, CHAT_REQUIRED, {**SHARED, **CHAT_ONLY}),
        (COMPLETION, COMPLETION_REQUIRED, {**SHARED, **COMPLETION_ONLY}),
    )
    for field, sample in table.items()
]


@pytest.mark.parametrize(("schema", "required", "field", "sample"), CASES)
def test_each_vllm_field_is_honoured_ignored_or_refused_as_decided_and_says_why(
    schema: type[protocol._Request],
    required: dict[str, Any],
    field: str,
    sample: tuple[Any, Decision, Any],
) -> None:
    value, decided, _ = sample
    made, reason = decision(schema, required, field, value)
    assert made == decided, (field, made, reason)
    if made != HONOURED:
        assert len(reason) > 10, (field, reason)  # a reason, not a bare "no"


@pytest.mark.parametrize(("schema", "required", "field", "sample"), CASES)
def test_vllm_defaults_and_null_ask_for_nothing_and_are_accepted(
    schema: type[protocol._Request],
    required: dict[str, Any],
    field: str,
    sample: tuple[Any, Decision, Any],
) -> None:
    default = sample[2]
    reserved = field in protocol.RESERVED_FIELDS  # refused whatever its value, even null
    for value in (None, default):
        error = parse(schema, {**required, field: value})
        assert (error is not None) == reserved, (field, value, error)


def sampling(schema: type[protocol._Request], fields: dict[str, Any]) -> dict[str, Any]:
    required = CHAT_REQUIRED if schema is CHAT else COMPLETION_REQUIRED
    parsed = protocol.parse_request(orjson.dumps({**required, **fields}), schema)
    return parsed.sampling_params(8)


@pytest.mark.parametrize("schema", [CHAT, COMPLETION])
@pytest.mark.parametrize(
    ("fields", "grammar"),
    [
        ({"guided_json": {"type": "object"}}, {"json_schema": '{"type":"object"}'}),
        ({"guided_json": '{"type": "object"}'}, {"json_schema": '{"type": "object"}'}),
        ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"guided_grammar": 'root ::= "a"'}, {"ebnf": 'root ::= "a"'}),
        ({"guided_choice": ["yes", 'a "b"']}, {"ebnf": 'root ::= "yes" | "a \\"b\\""'}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type":"object"}'}),
    ],
)
def test_vllms_guided_fields_become_sglangs_grammars(
    schema: type[protocol._Request], fields: dict[str, Any], grammar: dict[str, str]
) -> None:
    assert sampling(schema, fields) == {"max_new_tokens": 8, **grammar}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "regex": "b"}, "regex"),
        ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_choice"),
        (
            {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
            "guided_json",
        ),
    ],
)
def test_two_constraints_through_either_name_are_refused(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as refused:
        sampling(CHAT, fields)
    assert refused.value.status == 400 and refused.value.param == param


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "constraint",
    [
        {"guided_choice": ["0"]},
        {"regex": "0"},
        {"response_format": {"type": "json_object"}},
        {"tools": [_TOOL], "tool_choice": "required"},
    ],
    ids=["guided_choice", "regex", "response_format", "forced tool call"],
)
def test_min_tokens_above_one_is_refused_beside_an_output_constraint(
    constraint: dict[str, Any],
) -> None:
    # A one-token choice with min_tokens 2 made the real PD pair's decode fail the request
    # (a 500 from SGLang, 502 from the gateway): found by scripts/soak fuzz, seed 2933923247.
    with pytest.raises(APIError) as refused:
        sampling(CHAT, {**constraint, "min_tokens": 2})
    assert refused.value.status == 400 and refused.value.param == "min_tokens"


def test_min_tokens_reaches_the_engine_at_one_beside_a_constraint_and_above_one_without() -> None:
    assert sampling(CHAT, {"guided_choice": ["0"], "min_tokens": 1})["min_new_tokens"] == 1
    assert sampling(COMPLETION, {"min_tokens": 5})["min_new_tokens"] == 5


def test_a_guided_json_schema_is_checked_and_bounded_as_response_formats_are() -> None:
    bad = parse(CHAT, {**CHAT_REQUIRED, "guided_json": {"type": "nope"}})
    assert bad is not None and bad.param == "guided_json" and bad.code == "invalid_value"
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    too_deep = parse(CHAT, {**CHAT_REQUIRED, "guided_json": deep})
    assert too_deep is not None and too_deep.param == "guided_json"
    as_text = parse(CHAT, {**CHAT_REQUIRED, "guided_json": orjson.dumps(deep).decode()})
    assert as_text is not None and as_text.param == "guided_json"


def test_guided_choice_is_bounded_in_count_and_length() -> None:
    many = parse(CHAT, {**CHAT_REQUIRED, "guided_choice": ["x"] * (protocol.MAX_CHOICES + 1)})
    long = parse(CHAT, {**CHAT_REQUIRED, "guided_choice": ["x" * protocol.MAX_GRAMMAR_CHARS] * 2})
    empty = parse(CHAT, {**CHAT_REQUIRED, "guided_choice": [""]})
    assert all(
        e is not None and e.param and "guided_choice" in e.param for e in (many, long, empty)
    )


def test_vllms_stop_string_and_spacing_names_reach_the_engine_as_sglangs() -> None:
    assert sampling(CHAT, {"include_stop_str_in_output": True})["no_stop_trim"] is True
    assert sampling(COMPLETION, {"spaces_between_special_tokens": False}) == {
        "max_new_tokens": 8,
        "spaces_between_special_tokens": False,
    }
    # SGLang reads it from chat_template_kwargs; the top-level field wins.
    kwargs = {"chat_template_kwargs": {"spaces_between_special_tokens": False}}
    assert sampling(CHAT, kwargs)["spaces_between_special_tokens"] is False
    both = {**kwargs, "spaces_between_special_tokens": True}
    assert sampling(CHAT, both)["spaces_between_special_tokens"] is True
    disagree = parse(
        CHAT, {**CHAT_REQUIRED, "include_stop_str_in_output": True, "no_stop_trim": False}
    )
    assert disagree is not None and disagree.param == "include_stop_str_in_output"


def test_an_ignored_field_reaches_no_engine() -> None:
    assert sampling(CHAT, {"length_penalty": 0.5, "guided_decoding_backend": "outlines"}) == {
        "max_new_tokens": 8
    }


def test_continuous_usage_stats_is_read() -> None:
    parsed = protocol.parse_request(
        orjson.dumps(
            {**CHAT_REQUIRED, "stream": True, "stream_options": {"continuous_usage_stats": True}}
        ),
        CHAT,
    )
    assert parsed.continuous_usage and not parsed.include_usage


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        # As SGLang: a reasoning effort turns thinking on or off unless the kwargs say.
        (
            {"reasoning_effort": "none"},
            {"reasoning_effort": "none", "thinking": False, "enable_thinking": False},
        ),
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning_effort": "low", "enable_thinking": False, "thinking": True},
        ),
    ],
)
def test_the_templates_variables_are_sglangs(
    fields: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    parsed = protocol.parse_request(orjson.dumps({**CHAT_REQUIRED, **fields}), CHAT)
    assert parsed.template_kwargs() == expected


def test_a_reserved_field_is_refused_saying_why() -> None:
    for field in ("rid", "custom_logit_processor", "session_id", "priority"):
        error = parse(COMPLETION, {**COMPLETION_REQUIRED, field: "x"})
        assert error is not None and error.code == "reserved_parameter"
        assert error.message.startswith(f"'{field}' may not be supplied by a client: ")
        assert error.message.endswith(protocol.RESERVED_FIELDS[field] + ".")
