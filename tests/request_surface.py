"""What the gateway does with a request field an engine's clients send: honour it, accept and
ignore it for a documented reason, or refuse it with a 400 that says why.

Shared by the conformance tests of SGLang's request models (``tests/engine_parity``, walked
from the installed SGLang) and of vLLM's extension fields (``tests/unit/openai``).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from gateway.common.errors import APIError
from gateway.openai import protocol

Decision = Literal["honoured", "ignored", "refused"]
HONOURED: Decision = "honoured"
IGNORED: Decision = "ignored"
REFUSED: Decision = "refused"

CHAT = protocol.ChatCompletionRequest
COMPLETION = protocol.CompletionRequest
CHAT_REQUIRED: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION_REQUIRED: dict[str, Any] = {"model": "m", "prompt": "Hi"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# Fields that are valid only beside another.
WITH: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": TOOLS},
    "parallel_tool_calls": {"tools": TOOLS},
}


def parse(schema: type[protocol._Request], body: dict[str, Any]) -> APIError | None:
    try:
        protocol.parse_request(orjson.dumps(body), schema)
    except APIError as error:
        return error
    return None


def decision(
    schema: type[protocol._Request], required: dict[str, Any], field: str, value: Any
) -> tuple[Decision, str]:
    """What the gateway does with ``field`` sent at ``value``, and why where it does not honour
    it. A refusal must be for a reason that names the field (``unsupported_parameter`` or
    ``reserved_parameter``), never "unknown" or "invalid"; acceptance means the model declares
    the field, and it is honoured unless marked ``protocol.Ignored``."""
    error = parse(schema, {**required, **WITH.get(field, {}), field: value})
    if error is not None:
        assert error.code in ("unsupported_parameter", "reserved_parameter"), (
            field,
            error.code,
            error.message,
        )
        assert error.param is not None and field in error.param, (field, error.param)
        _, _, reason = error.message.partition(": ")
        return REFUSED, reason
    assert field in schema.model_fields, field
    reason = protocol.ignored_fields(schema).get(field)
    return (IGNORED, reason) if reason is not None else (HONOURED, "")
