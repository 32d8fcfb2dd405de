"""The gateway's chat-template rendering with tools and tool messages equals what
``transformers``' ``apply_chat_template`` renders for the same template and messages (engine
venv, where transformers is installed), for the dev model's template the tests use; and with a
request's ``chat_template_kwargs``, for that template with Qwen3's thinking switch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from gateway.dev.model import ensure_tiny_model  # noqa: E402
from gateway.openai.protocol import ChatCompletionRequest  # noqa: E402
from gateway.openai.tokenize import ChatTurn, ModelTokenizer  # noqa: E402
from gateway.openai.tool_use import template_tools  # noqa: E402
from tests.templates import thinking_model  # noqa: E402

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, in 北京 too",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"weather": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain", "name": "get_weather"},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_gateway_renders_tools_and_tool_messages_as_apply_chat_template(
    model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    # The request as a client sends it, through the gateway's own parsing.
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    )
    turns = [ChatTurn(m.role, m.text(), m.template_fields()) for m in request.messages]
    rendered = ModelTokenizer(model_dir).render_chat(turns, template_tools(request))
    assert rendered == expected
    if tools:
        assert "get_weather" in rendered and "<tools>" in rendered


# ---- chat_template_kwargs (issue 41) ------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_model(model_dir, tmp_path_factory.mktemp("thinking") / "model")


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"enable_thinking": False, "system_prompt": "Be brief."}},
        {"chat_template_kwargs": {"not_in_the_template": 1}},
        {"reasoning_effort": "none"},
    ],
    ids=["none", "thinking off", "thinking on", "two variables", "unread", "effort none"],
)
def test_chat_template_kwargs_render_and_encode_as_apply_chat_template(
    thinking_dir: Path, fields: dict[str, Any]
) -> None:
    """The request's variables for the template, as the gateway gives them, render the same text
    and ids as ``apply_chat_template`` given the same variables (as SGLang passes them)."""
    messages = CONVERSATIONS[0]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
    kwargs = request.template_kwargs() or {}
    hf = transformers.AutoTokenizer.from_pretrained(str(thinking_dir))
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    tokenizer = ModelTokenizer(thinking_dir)
    turns = [ChatTurn(m.role, m.text(), m.template_fields()) for m in request.messages]
    assert tokenizer.render_chat(turns, template_kwargs=kwargs) == expected
    ids = asyncio.run(tokenizer.encode_chat(turns, template_kwargs=kwargs))
    assert ids == hf(expected, add_special_tokens=False)["input_ids"]
    off = kwargs.get("enable_thinking") is False
    assert expected.endswith("<think>\n\n</think>\n\n") is off
