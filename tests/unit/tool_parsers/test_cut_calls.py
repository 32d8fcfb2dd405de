"""Constrained calls (``tool_choice`` required or named) cut short by the client's own limit.

An output decoded under the calls' JSON schema can stop unfinished only where the client set a
limit (``max_tokens``, a stop sequence): that is an ordinary finish, not a broken constraint.
Its complete calls are calls, what follows them is text; every complete call is still held to
the constraint, and an output that stopped at its own end must still be complete.
"""

from __future__ import annotations

import pytest

from gateway.tool_parsers import Function, InvalidToolOutput, OutputParser, ParsedOutput

FUNCTIONS = {"get_weather": Function("get_weather", {"type": "object"})}
ONE = '{"name": "get_weather", "parameters": {"city": "Rome"}}'


def parsed(text: str, cut: bool) -> ParsedOutput:
    parser = OutputParser(reasoning=None, tool_format=None, functions=FUNCTIONS, constrained=True)
    return parser.parse(text, cut)


def streamed(pieces: list[str], cut: bool) -> ParsedOutput:
    parser = OutputParser(reasoning=None, tool_format=None, functions=FUNCTIONS, constrained=True)
    out = ParsedOutput()
    for piece in pieces:
        step = parser.feed(piece)
        out.text += step.text
        out.calls += step.calls
    last = parser.finish(cut)
    return ParsedOutput("", out.text + last.text, out.calls + last.calls)


@pytest.mark.parametrize(
    ("text", "calls", "rest"),
    [
        ('[{"name": "get_weather", "parameters": {"city": "Ro', 0, '[{"name": "get_weather"'),
        ("[", 0, "["),
        ("  ", 0, ""),  # cut before the array began
        (f"[{ONE}, " + '{"name": "get_w', 1, '{"name": "get_w'),
        (f"[{ONE}]<|eos|>", 1, "<|eos|>"),  # a stop sequence kept (no_stop_trim)
    ],
)
def test_a_cut_output_gives_its_complete_calls_and_the_rest_as_text(
    text: str, calls: int, rest: str
) -> None:
    for out in (parsed(text, cut=True), streamed([text[:7], text[7:]], cut=True)):
        assert len(out.calls) == calls
        assert all(c.arguments == '{"city": "Rome"}' for c in out.calls)
        assert out.text.startswith(rest)


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "parameters": {"city": "Ro',
        f"[{ONE}]<|eos|>",
        "  ",
    ],
)
def test_the_same_output_at_its_own_end_broke_the_constraint(text: str) -> None:
    with pytest.raises(InvalidToolOutput):
        parsed(text, cut=False)


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "other", "parameters": {}}, {"name": "get_w',  # a function nobody offered
        'prose [{"name": "get_weather", "parameters": {}}',  # not the array at all
        "[]",  # no call in a closed array
    ],
)
def test_what_no_limit_explains_still_fails_when_cut(text: str) -> None:
    with pytest.raises(InvalidToolOutput):
        parsed(text, cut=True)
