"""A request's JSON schemas are bounded by their shape (``schema_shape.SCHEMA_LIMITS``) before
any of them is checked against its metaschema: past a bound, a cheap 400 naming it; at the
bounds, the check itself still runs to its end (no RecursionError, from deep in a stack too).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from gateway.common.errors import APIError
from gateway.openai import protocol
from gateway.openai.schema_shape import SCHEMA_LIMITS, schema_shape_error

LIMITS = SCHEMA_LIMITS
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": MESSAGES, **fields})


def response_format(schema: Any) -> bytes:
    return chat(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )


def tools(*schemas: Any) -> bytes:
    return chat(
        tools=[
            {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
            for i, schema in enumerate(schemas)
        ]
    )


def properties(count: int, start: int = 0) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "description": "one field of many"}
            for i in range(start, start + count)
        },
    }


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def nested(levels: int, wrap: Callable[[Any], Any]) -> Any:
    """A schema ``levels`` JSON levels deep (or one less, where a wrap adds two), built by
    ``wrap`` around a leaf."""
    schema: Any = {"type": "string"}
    step = depth(wrap(schema)) - depth(schema)
    reached = depth(schema)
    while reached + step <= levels:
        schema, reached = wrap(schema), reached + step
    return schema


def refused(payload: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        protocol.parse_request(payload, protocol.ChatCompletionRequest)
    error = caught.value
    assert (error.status, error.type, error.code) == (400, "invalid_request_error", "invalid_value")
    return error


@pytest.fixture
def no_metaschema_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any metaschema check fails the test: a refusal by shape must come before it."""

    def forbidden(schema: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the schema reached the metaschema check")  # pydantic catches asserts

    checker = types.SimpleNamespace(
        meta=types.SimpleNamespace(validate=forbidden), ValidationError=ValueError
    )
    monkeypatch.setattr(protocol, "jsonschema_rs", checker)


# ---- past a bound: a 400 naming it, before any metaschema check --------------------------


def test_the_issues_3500_property_schema_is_refused_by_its_count(no_metaschema_check: None) -> None:
    payload = response_format(properties(3500))
    assert 200_000 < len(payload) < 256 * 1024  # parsed on the event loop
    error = refused(payload)
    assert error.param == "response_format.json_schema.schema"
    assert f"at most {LIMITS.properties} properties" in error.message


def test_a_schema_nested_900_deep_is_a_400_not_a_recursion_error() -> None:
    # Written out, since orjson writes no JSON deeper than 255 levels (it reads 1,024).
    levels = 450  # each of two JSON levels: 900
    schema = '{"type":"object","properties":{"a":' * levels + "{}" + "}}" * levels
    payload = response_format({}).replace(b'"schema":{}', b'"schema":' + schema.encode())
    error = refused(payload)
    assert f"at most {LIMITS.depth} levels" in error.message


def test_properties_count_across_all_tools_together(no_metaschema_check: None) -> None:
    half = LIMITS.properties // 2
    error = refused(tools(properties(half), properties(half, half), properties(1, 2 * half)))
    assert error.param == "tools.2.function.parameters"


@pytest.mark.parametrize(
    ("schema", "bound"),
    [
        ({"allOf": [{} for _ in range(LIMITS.containers)]}, "objects and arrays"),
        ({"enum": list(range(LIMITS.values + 1))}, "values"),
        (
            {"properties": {f"p{i}": {"pattern": "a+"} for i in range(LIMITS.patterns + 1)}},
            f"at most {LIMITS.patterns} patterns",
        ),
        ({"patternProperties": {f"^p{i}": {} for i in range(LIMITS.patterns + 1)}}, "patterns"),
    ],
    ids=["containers", "values", "pattern keywords", "patternProperties"],
)
def test_each_bound_of_the_shape_is_a_400_naming_it(
    no_metaschema_check: None, schema: dict[str, Any], bound: str
) -> None:
    assert bound in refused(response_format(schema)).message


def test_the_json_schema_field_is_bounded_too(no_metaschema_check: None) -> None:
    text = orjson.dumps(nested(200, lambda inner: {"not": inner})).decode()
    assert refused(chat(json_schema=text)).param == "json_schema"


def test_more_tools_than_allowed_are_refused_before_their_schemas_are_read() -> None:
    error = refused(tools(*[{"type": "object"}] * (protocol.MAX_TOOLS + 1)))
    assert error.param == "tools"


# ---- at the bounds: accepted, and the metaschema check runs to its end ----------------------


def deep_in_the_stack(frames: int, call: Callable[[], None]) -> None:
    """``call`` with ``frames`` frames already on the stack (a handler is called from deep in
    uvicorn, Starlette and the pipeline)."""
    if frames <= 0:
        call()
        return
    deep_in_the_stack(frames - 1, call)


# The costliest shapes in Python frames per JSON level for jsonschema's check.
DEEPEST = {
    "not": lambda inner: {"not": inner},
    "items": lambda inner: {"type": "array", "items": inner},
    "properties": lambda inner: {"type": "object", "properties": {"a": inner}},
    "anyOf": lambda inner: {"anyOf": [inner, {"type": "null"}]},
}


@pytest.mark.parametrize("wrap", DEEPEST.values(), ids=DEEPEST.keys())
def test_the_deepest_schema_accepted_is_checked_without_recursion_error(
    wrap: Callable[[Any], Any],
) -> None:
    schema = nested(LIMITS.depth, wrap)
    frames = 300
    assert sys.getrecursionlimit() - frames > 0
    deep_in_the_stack(
        frames,
        lambda: protocol.parse_request(response_format(schema), protocol.ChatCompletionRequest),
    )


def test_openais_largest_strict_schema_shape_is_accepted() -> None:
    """Ten levels of objects, each in a nullable array (OpenAI's documented nesting limit)."""
    schema: Any = {"type": "string"}
    for _ in range(10):
        schema = {
            "type": "object",
            "properties": {
                "items": {"anyOf": [{"type": "array", "items": schema}, {"type": "null"}]}
            },
            "required": ["items"],
            "additionalProperties": False,
        }
    assert depth(schema) <= LIMITS.depth
    protocol.parse_request(response_format(schema), protocol.ChatCompletionRequest)


def test_the_largest_counts_accepted_are_accepted() -> None:
    patterns = {f"p{i}": {"type": "string", "pattern": "^a+$"} for i in range(LIMITS.patterns)}
    rest = properties(LIMITS.properties - LIMITS.patterns)
    rest["properties"].update(patterns)
    protocol.parse_request(response_format(rest), protocol.ChatCompletionRequest)


def test_a_metaschema_error_quotes_a_prefix_of_the_schema_only() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "x" * 100_000}}}
    error = refused(response_format(schema))
    assert len(error.message) < 400


def test_the_walk_counts_the_schemas_as_given() -> None:
    def schemas() -> Iterator[tuple[str, Any]]:
        yield "a", properties(LIMITS.properties)
        yield "b", "not a schema"  # skipped: validation refuses it
        yield "c", {"type": "object"}

    assert schema_shape_error(schemas()) is None


# ---- within the bounds: the metaschema check itself ----------------------------------------


def test_a_schema_that_breaks_the_metaschema_is_a_400_naming_the_field() -> None:
    error = refused(response_format({"type": "object", "properties": {"a": {"type": 5}}}))
    assert error.param == "response_format.json_schema.schema"
    assert error.message.startswith("Invalid JSON schema:")


def test_a_schema_at_every_bound_passes_the_metaschema_check() -> None:
    schema = properties(LIMITS.properties)
    parsed = protocol.parse_request(response_format(schema), protocol.ChatCompletionRequest)
    assert parsed.response_format is not None
