"""The gateway applies ``engine_bounds.FIELD_BOUNDS``: each field's smallest and largest value in
the table is accepted, and the nearest value past either end is a 400 naming the field and the
bound, on every route that has the field. (``tests/engine_bounds`` holds the same table against
SGLang's own code; ``tests/e2e/test_engine_bounds_e2e.py`` against a running SGLang pair.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import pytest

from gateway.common.errors import APIError
from gateway.openai import protocol
from gateway.openai.engine_bounds import FIELD_BOUNDS, INT32_MAX, TOP_K_ALL, Bound

CHAT = protocol.ChatCompletionRequest
COMPLETION = protocol.CompletionRequest
ROUTES = {CHAT: {"messages": [{"role": "user", "content": "Hi"}]}, COMPLETION: {"prompt": "Hi"}}
ONLY_ON = {
    "max_completion_tokens": CHAT,
    "top_logprobs": CHAT,
    "logprobs": COMPLETION,
    "best_of": COMPLETION,
}


def body(schema: type[protocol._Request], name: str, value: Any) -> bytes:
    """A request with the table's field ``name`` at ``value`` (and what the field needs)."""
    fields: dict[str, Any] = {"model": "m", **ROUTES[schema]}
    if name == "logit_bias (token id)":
        fields["logit_bias"] = {str(value): 1.0}
    elif name == "logit_bias (bias)":
        fields["logit_bias"] = {"5": value}
    elif name == "stop_token_ids":
        fields["stop_token_ids"] = [value]
    else:
        fields[name] = value
    if name == "top_logprobs":
        fields["logprobs"] = True
    if name == "max_tokens" and schema is COMPLETION and value == 0:
        fields["echo"] = True
    return json.dumps(fields).encode()  # orjson writes no integer past 64 bits


CASES = [
    pytest.param(schema, name, bound, id=f"{schema.__name__}-{name}")
    for name, bound in FIELD_BOUNDS.items()
    for schema in ROUTES
    if ONLY_ON.get(name, schema) is schema
]


def refused(schema: type[protocol._Request], name: str, value: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        protocol.parse_request(body(schema, name, value), schema)
    return caught.value


@pytest.mark.parametrize(("schema", "name", "bound"), CASES)
def test_the_smallest_and_largest_value_in_the_table_are_accepted(
    schema: type[protocol._Request], name: str, bound: Bound
) -> None:
    for value in (bound.smallest(), bound.largest(), *bound.sentinels):
        protocol.parse_request(body(schema, name, value), schema)


@pytest.mark.parametrize(("schema", "name", "bound"), CASES)
def test_one_past_either_end_is_a_400_naming_the_field_and_the_bound(
    schema: type[protocol._Request], name: str, bound: Bound
) -> None:
    below, above = bound.just_past()
    for value, crossed in ((below, bound.low), (above, bound.high)):
        if name == "max_tokens" and schema is COMPLETION and value == 0:
            continue  # a completion's max_tokens 0 is echo's (the engine is sent 1)
        error = refused(schema, name, value)
        assert (error.status, error.type, error.code) == (
            400,
            "invalid_request_error",
            "invalid_value",
        )
        assert error.param is not None and error.param.startswith(name.split(" ")[0])
        if not -(2**63) <= value < 2**64:
            continue  # the JSON parser reads it as a float: refused as no integer at all
        numbers = {float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", error.message)}
        assert float(crossed) in numbers, error.message


def test_a_top_k_of_a_quintillion_is_refused_before_the_engine() -> None:
    # It passed the gateway and overflowed SGLang's int32 top_k tensor, killing the worker.
    error = refused(CHAT, "top_k", 1_000_000_000_000_000_000)
    assert error.status == 400 and error.param == "top_k" and str(TOP_K_ALL) in error.message


def test_top_k_minus_one_still_means_the_whole_vocabulary_and_zero_is_refused() -> None:
    parsed = protocol.parse_request(body(CHAT, "top_k", -1), CHAT)
    assert parsed.sampling_params(8)["top_k"] == -1
    assert refused(CHAT, "top_k", 0).param == "top_k"


@pytest.mark.parametrize(
    "key",
    [
        "²",  # str.isdigit, and a 500 from int() before
        "٣",  # Arabic-Indic three: int() reads it as 3
        "5\n",
        " 5",
        "+5",
        "-1",
        "5.0",
        "",
        "0" * 11,  # more digits than an int32 has
        str(INT32_MAX + 1),
        "9" * 5000,  # int() refuses a string this long (a 500 before)
    ],
    ids=lambda key: ascii(key)[:16],
)
def test_a_logit_bias_key_that_is_not_a_token_id_in_ascii_digits_is_a_400(key: str) -> None:
    payload = orjson.dumps({"model": "m", "prompt": "Hi", "logit_bias": {key: 1.0}})
    with pytest.raises(APIError) as caught:
        protocol.parse_request(payload, COMPLETION)
    assert caught.value.status == 400 and caught.value.param == "logit_bias"
    assert len(caught.value.message) < 300  # quotes a prefix of the key, never all of it


def test_every_numeric_field_the_engine_receives_is_in_the_table() -> None:
    """A field added to the request that reaches SGLang as a number must be bounded here."""
    chat = protocol.parse_request(
        orjson.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "Hi"}],
                "temperature": 0.5,
                "top_p": 0.5,
                "top_k": 5,
                "min_p": 0.1,
                "presence_penalty": 0.1,
                "frequency_penalty": 0.1,
                "repetition_penalty": 1.1,
                "min_tokens": 1,
                "stop_token_ids": [1],
                "seed": 1,
                "logit_bias": {"5": 1.0},
                "stop": ["x"],
                "ignore_eos": True,
                "skip_special_tokens": True,
                "no_stop_trim": True,
                "regex": "a+",
            }
        ),
        CHAT,
    )
    sent = chat.sampling_params(8)
    bounded = {bound.engine_name for bound in FIELD_BOUNDS.values()}
    # Booleans and strings aside (``stop``: strings, bounded in count by MAX_STOP).
    numeric = {
        name for name, value in sent.items() if not isinstance(value, bool | str) and name != "stop"
    }
    assert numeric == bounded - {None, "top_logprobs_num"}
