"""A worker's refusal tells the client why only where it is a grammar compiler's verdict."""

from __future__ import annotations

import pytest

from gateway.workers.refusals import engine_refusal

# As SGLang 0.5.23 answered them (its grammar manager's words around xgrammar's), seen in the
# gateway's log of a fuzzing run and from xgrammar directly.
GRAMMAR_REFUSALS = [
    (
        "Failed to compile regex grammar: [21:47:16] /project/cpp/regex_converter.cc:83: "
        "Regex parsing error at position 10: The parenthesis is not closed.\n",
        "its regex does not compile (Regex parsing error at position 10: The parenthesis is "
        "not closed)",
    ),
    (
        "Failed to compile ebnf grammar: [21:47:16] /project/cpp/grammar_parser.cc:820: EBNF "
        'parser error at line 1, column 1: The root rule with name "root" is not found\n',
        "its EBNF grammar does not compile (EBNF parser error at line 1, column 1: The root rule "
        'with name "root" is not found)',
    ),
    (
        "Failed to compile ebnf grammar: Grammar compilation failed: 'utf-8' codec can't decode "
        "byte 0xc3 in position 107: invalid continuation byte",
        "its EBNF grammar does not compile ('utf-8' codec can't decode byte 0xc3 in position "
        "107: invalid continuation byte)",
    ),
    (
        "Failed to compile json grammar: [22:15:22] /project/cpp/json_schema_converter.cc:4175: "
        'Unsupported type "strin"\n',
        'its JSON schema does not compile (Unsupported type "strin")',
    ),
    (
        "Failed to compile structural_tag grammar: Expecting value: line 1 column 1 (char 0)",
        "its structural tag does not compile (Expecting value: line 1 column 1 (char 0))",
    ),
]


@pytest.mark.parametrize(("engine_message", "said"), GRAMMAR_REFUSALS)
def test_a_grammar_the_compiler_refused_is_named_with_the_compilers_verdict(
    engine_message: str, said: str
) -> None:
    error = engine_refusal("prefill", engine_message)
    assert (error.status, error.code) == (400, "engine_rejected")
    assert error.type == "invalid_request_error"
    assert error.message == f"The prefill worker refused the request: {said}."
    assert "/project/" not in error.message and ".cc:" not in error.message
    # The verdict may quote the grammar: the audit event names the kind alone.
    assert error.audit_detail is not None and "(" not in error.audit_detail


@pytest.mark.parametrize(
    "engine_message",
    [
        "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        "input_ids cannot be empty",
        "Failed to compile the graph",  # not a grammar's refusal, though it begins alike
        "",
    ],
)
def test_any_other_refusal_keeps_the_engines_words_to_the_log(engine_message: str) -> None:
    error = engine_refusal("decode", engine_message)
    assert (error.status, error.code) == (400, "engine_rejected")
    assert error.message == "The decode worker refused the request."
    assert error.audit_detail is None


def test_a_long_verdict_is_cut_and_put_on_one_line() -> None:
    verdict = "Unexpected\ttoken\x00 " + "x" * 2000 + "\nsecond line"
    error = engine_refusal("decode", f"Failed to compile regex grammar: {verdict}")
    said = error.message.removeprefix("The decode worker refused the request: its regex ")
    assert said.startswith("does not compile (Unexpected token x")
    assert "\n" not in error.message and "\t" not in error.message and "\x00" not in error.message
    assert "second line" not in error.message and len(error.message) < 400
