"""The gateway's tool-call and reasoning parsers, per family, whole and streamed (SGLang parity
is tests/engine_parity; these pin the behaviour the gateway relies on)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.tool_parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    Function,
    InvalidToolOutput,
    OutputParser,
    ParsedOutput,
    call_schema,
)
from gateway.tool_parsers.base import parse

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
FUNCTIONS = {"get_weather": Function("get_weather", WEATHER)}
CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})

ONE_CALL = {
    "hermes": f"Sure.<tool_call>{CALL}</tool_call>",
    "qwen25": f"Sure.\n<tool_call>\n{CALL}\n</tool_call>",
    "llama3": "Sure.<|python_tag|>"
    + json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}),
    "mistral": f"Sure. [TOOL_CALLS] [{CALL}]",
    "deepseekv3": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseekv31": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call>",
    "glm47": "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "</tool_call>",
}


def _streamed(parser: OutputParser, text: str) -> ParsedOutput:
    out = ParsedOutput()
    for char in text:
        piece = parser.feed(char)
        out.reasoning += piece.reasoning
        out.text += piece.text
        out.calls += piece.calls
    last = parser.finish()
    return ParsedOutput(
        out.reasoning + last.reasoning, out.text + last.text, out.calls + last.calls
    )


def test_every_named_family_has_a_case() -> None:
    assert {name for name in TOOL_CALL_PARSERS if name not in ("qwen", "glm")} == set(ONE_CALL)


@pytest.mark.parametrize("family", sorted(ONE_CALL))
def test_one_call_is_parsed_with_the_text_before_it_and_no_tag_left(family: str) -> None:
    parsed = parse(TOOL_CALL_PARSERS[family](), ONE_CALL[family], FUNCTIONS)
    assert parsed.text == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("family", sorted(ONE_CALL))
def test_streamed_a_character_at_a_time_gives_the_whole_answer_and_never_a_tag(
    family: str,
) -> None:
    text = ONE_CALL[family]
    parser = OutputParser(reasoning=None, tool_format=family, functions=FUNCTIONS)
    whole = OutputParser(reasoning=None, tool_format=family, functions=FUNCTIONS).parse(text)
    streamed = _streamed(parser, text)
    assert streamed.calls == whole.calls and len(whole.calls) == 1
    assert streamed.text.strip() == "Sure."
    for tag in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<｜tool"):
        assert tag not in streamed.text


def test_a_call_to_a_function_not_offered_is_dropped() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse(TOOL_CALL_PARSERS["hermes"](), text, FUNCTIONS).calls == []


def test_malformed_call_json_is_neither_a_call_nor_text() -> None:
    parsed = parse(
        TOOL_CALL_PARSERS["hermes"](), 'Hm.<tool_call>{"name": oops}</tool_call>', FUNCTIONS
    )
    assert parsed.calls == [] and parsed.text == "Hm."


def test_arguments_are_json_text_with_non_ascii_kept_so_scans_see_it() -> None:
    call = json.dumps({"name": "get_weather", "arguments": {"city": "\u27e6cny:x\u27e7"}})
    parsed = parse(TOOL_CALL_PARSERS["hermes"](), f"<tool_call>{call}</tool_call>", FUNCTIONS)
    assert "⟦cny:x⟧" in parsed.calls[0].arguments  # written escaped, handed out literal


def test_glm_values_follow_the_functions_schema() -> None:
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    call = parse(TOOL_CALL_PARSERS["glm47"](), text, FUNCTIONS).calls[0]
    assert json.loads(call.arguments) == {"city": "123", "days": 3}


@pytest.mark.parametrize(
    ("family", "text", "reasoning", "answer"),
    [
        ("deepseek-r1", "plan</think>answer", "plan", "answer"),
        ("deepseek-r1", "<think>plan</think>answer", "plan", "answer"),
        ("deepseek-r1", "cut off", "cut off", ""),
        ("qwen3", "<think>plan</think>answer", "plan", "answer"),
        ("qwen3", "no thinking", "", "no thinking"),
        ("qwen3", "<think>plan<tool_call>x", "plan", "<tool_call>x"),
        ("glm45", "<think>a</think>b", "a", "b"),
    ],
)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(
    family: str, text: str, reasoning: str, answer: str
) -> None:
    whole = OutputParser(reasoning=family, tool_format=None, functions={}).parse(text)
    assert (whole.reasoning, whole.text) == (reasoning, answer)
    streamed = _streamed(OutputParser(reasoning=family, tool_format=None, functions={}), text)
    assert (streamed.reasoning, streamed.text) == (reasoning, answer)
    assert family in REASONING_PARSERS


def test_reasoning_then_a_call_gives_reasoning_and_the_call() -> None:
    text = f"<think>I need the weather.</think>\n<tool_call>\n{CALL}\n</tool_call>"
    parser = OutputParser(reasoning="qwen3", tool_format="qwen25", functions=FUNCTIONS)
    out = _streamed(parser, text)
    assert out.reasoning == "I need the weather."
    assert out.text.strip() == "" and [c.name for c in out.calls] == ["get_weather"]


def test_constrained_output_is_calls_and_anything_else_fails() -> None:
    ok = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    parser = OutputParser(
        reasoning="qwen3", tool_format="qwen25", functions=FUNCTIONS, constrained=True
    )
    assert [c.arguments for c in _streamed(parser, ok).calls] == ['{"city": "Rome"}']
    for bad in (
        '[{"name": "get_weather", "parameters": {"city": "Ro',  # unfinished, not cut short
        '[{"name": "other", "parameters": {}}]',
        "[]",
        'text [{"name": "get_weather", "parameters": {}}]',
    ):
        with pytest.raises(InvalidToolOutput):
            OutputParser(
                reasoning=None, tool_format=None, functions=FUNCTIONS, constrained=True
            ).parse(bad)


def test_call_schema_names_each_function_and_bounds_parallel_calls() -> None:
    functions = [Function("a", {"type": "object"}), Function("b", WEATHER)]
    schema = call_schema(functions, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert "maxItems" not in call_schema(functions[:1], parallel=True)


def test_call_schema_hoists_parameter_defs_to_the_root_where_refs_point() -> None:
    city = {"type": "string"}
    with_defs = {
        "type": "object",
        "properties": {"c": {"$ref": "#/$defs/City"}},
        "$defs": {"City": city},
    }
    schema = call_schema([Function("a", with_defs)], parallel=True)
    assert (
        schema["$defs"] == {"City": city}
        and "$defs" not in schema["items"]["properties"]["parameters"]
    )
    jsonschema.validate([{"name": "a", "parameters": {"c": "Rome"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"c": 1}}], schema)
    clash = {**with_defs, "$defs": {"City": {"type": "integer"}}}
    with pytest.raises(ValueError, match="City"):
        call_schema([Function("a", with_defs), Function("b", clash)], parallel=True)
