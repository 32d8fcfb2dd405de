"""What the body-parsing process answers (``server.intake.parse_in_child``), called in process:
the same request the loop's own parse gives, and the refusals the shape scan makes early."""

from __future__ import annotations

import orjson

from gateway.openai import protocol
from gateway.server.intake import parse_in_child

MODEL = "tiny-llama"


def test_a_large_completion_body_parses_in_the_child_as_on_the_loop() -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "word " * 100_000, "max_tokens": 4})

    parsed, refused = parse_in_child(body, protocol.CompletionRequest)

    assert refused is None
    assert parsed == protocol.parse_request(body, protocol.CompletionRequest)


def test_a_large_chat_body_parses_in_the_child_as_on_the_loop() -> None:
    messages = [{"role": "user", "content": "word " * 100}] * 1_000
    body = orjson.dumps({"model": MODEL, "messages": messages})

    parsed, refused = parse_in_child(body, protocol.ChatCompletionRequest)

    assert refused is None
    assert parsed == protocol.parse_request(body, protocol.ChatCompletionRequest)


def test_a_chat_body_over_the_message_count_is_refused_with_the_count_error() -> None:
    messages = [{"role": "user", "content": "x"}] * (protocol.MAX_MESSAGES + 1)
    body = orjson.dumps({"model": MODEL, "messages": messages})

    parsed, refused = parse_in_child(body, protocol.ChatCompletionRequest)

    assert parsed is None
    assert refused == (
        400,
        f"Invalid value for 'messages': at most {protocol.MAX_MESSAGES} messages per request.",
        "invalid_request_error",
        "invalid_value",
        "messages",
    )


def test_a_completion_body_that_is_not_json_is_refused_as_on_the_loop() -> None:
    body = b'{"model": "tiny-llama", "prompt": "unterminated'

    parsed, refused = parse_in_child(body, protocol.CompletionRequest)

    assert parsed is None
    assert refused is not None and refused[0] == 400
