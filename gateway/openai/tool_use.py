"""A chat request's tools against its model's policy: how the prompt offers them and how the
outputs are read (``OutputSpec``), or a 400 where the model cannot take them.

``tool_choice`` ``required`` and a named function are enforced by constrained decoding (the
request's ``grammar``: a JSON schema of the calls); their outputs are then calls only.
"""

from __future__ import annotations

import secrets
from typing import Any

from gateway.common.errors import bad_request
from gateway.config.policies import ModelPolicy
from gateway.openai.protocol import ChatCompletionRequest
from gateway.tool_parsers import Function, OutputSpec


def output_spec(parsed: ChatCompletionRequest, model: ModelPolicy) -> OutputSpec | None:
    """How this request's outputs are read; None where they are plain text."""
    offered = parsed.offered_tools
    if parsed.tools and model.tool_call_parser is None:
        raise bad_request(
            f"The model '{model.name}' has no tool calling (its policy names no "
            "tool_call_parser); send the request without tools.",
            code="unsupported_parameter",
            param="tools",
        )
    # SGLang's ``separate_reasoning`` false: the thinking stays in the answer's text.
    reasoning = model.reasoning_parser if parsed.separate_reasoning is not False else None
    if not offered and reasoning is None:
        return None
    forced = parsed.forced_tools
    functions = {
        tool.function.name: Function(tool.function.name, tool.function.parameters or {})
        for tool in (forced if forced is not None else offered)
    }
    return OutputSpec(
        reasoning=reasoning,
        tool_format=model.tool_call_parser if offered else None,
        functions=functions,
        constrained=forced is not None,
        stream_reasoning=parsed.stream_reasoning is not False,
    )


def template_tools(parsed: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions as the chat template receives them (as the client sent them)."""
    offered = parsed.offered_tools
    return [tool.model_dump(exclude_none=True) for tool in offered] if offered else None


def new_tool_call_id() -> str:
    """A call's id: random, so unique within a response and across them."""
    return "call_" + secrets.token_hex(12)
