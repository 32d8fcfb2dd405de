"""The Responses API's wire format (``/v1/responses``): its request, the chat request it becomes,
and the Response object, its output items and its stream events.

A Responses request is served by the same generation core as a chat completion: its input
items (and the conversation a ``previous_response_id`` brings in) become chat turns, its fields
the chat request's (``chat_request``), so admission, tags, PD dispatch, verification and the
audit are the chat path's own. Only the request's shape and the answer's are of this module.

Requests are parsed as strictly as chat's: an unknown field is a 400 naming it, a field that
steers isolation is refused (``protocol.RESERVED_FIELDS``), and every documented field is
honoured, accepted without effect for a reason (``Ignored``), or refused with a 400 that says
why (built-in tools, background runs, stored conversations, prompt templates).

Items are kept in one canonical form (``canonical_items``, ``message_item`` and the others),
the form ``input_items`` lists and a stored response's conversation holds, so a follow-up
reads back exactly what a response answered.
"""

from __future__ import annotations

import secrets
import typing
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from gateway.common.errors import APIError, bad_request
from gateway.common.json_turns import JSONList
from gateway.openai.engine_bounds import FIELD_BOUNDS
from gateway.openai.protocol import (
    _TEXT_ONLY,
    MAX_GRAMMAR_CHARS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallParam,
    Ignored,
    TextPart,
    TokenLogprob,
    ToolCallParam,
    _only,
    _refuse,
    _refused,
    check_json_schema,
    check_schema_shapes,
    parse_request,
    too_many_messages,
)

# The most input items one request may carry (the chat request's message bound).
MAX_INPUT_ITEMS = MAX_MESSAGES
MAX_ID_CHARS = 256

_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_BUILT_IN = (
    "built-in tools run inside OpenAI's platform; this gateway serves function tools, which "
    "the client runs"
)
_CONVERSATIONS = (
    "conversations are not kept here; chain responses with previous_response_id, which the "
    "gateway stores per tenant"
)
_PREFIX_CACHE = "the prefix cache is the gateway's, keyed per tenant"
_NOT_RENDERED = "the chat template renders past turns without it, as chat completions here do"

Status = Literal["in_progress", "completed", "incomplete"]
# An output text's log probabilities: ``text_logprob``'s entries, or their JSON written already
# a slice at a time (``gateway.common.json_turns``).
Logprobs = list[dict[str, Any]] | orjson.Fragment


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Refused(BaseModel):
    """A documented item, part, tool or choice this gateway cannot take: its type names it,
    the rest is not looked at; validation refuses it, saying why (``_why``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    _what: str = "item"
    _why: str = _BUILT_IN

    @model_validator(mode="after")
    def _refuse_it(self) -> _Refused:
        raise _refuse(f"{self._what} of type {getattr(self, 'type', '?')}", self._why)


# ---- input content and items --------------------------------------------------------------


def _text_or_list(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


# ``str | list`` told apart by the value's type, so an error's location reads ``input.list.0``
# (not the union's generated label).
_TEXT_OR_LIST = Discriminator(_text_or_list)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Annotated[dict[str, Any] | None, Ignored(_PREFIX_CACHE)] = None


class OutputText(_Strict):
    """An assistant's text sent back as input (a previous answer replayed)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = Field(default=None, max_length=0)
    logprobs: Annotated[
        list[dict[str, Any]] | None, Ignored("a replayed answer's log probabilities are not read")
    ] = None


class RefusedContent(_Refused):
    type: Literal["input_image", "input_file", "input_audio", "refusal"]
    _what = "content part"
    _why = _TEXT_ONLY


Content = Annotated[InputText | OutputText | RefusedContent, Field(discriminator="type")]
_Caller = Annotated[
    dict[str, Any] | None,
    _refused(
        "programmatic tool calling is OpenAI's; calls here are the model's own",
        lambda caller: caller is None or caller == {"type": "direct"},
    ),
]
_Namespace = Annotated[str | None, _refused("functions have no namespaces here")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[list[Content], Tag("list"), Field(max_length=MAX_INPUT_ITEMS)],
        _TEXT_OR_LIST,
    ]
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    status: Status | None = None
    phase: Annotated[
        Literal["commentary", "final_answer"] | None, Ignored("the chat template has no phases")
    ] = None


class FunctionCallItem(_Strict):
    """A call the model made, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_GRAMMAR_CHARS)
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    status: Status | None = None
    namespace: _Namespace = None
    caller: _Caller = None
    async_: Annotated[bool | None, _only(False, "calls are answered in turn here")] = Field(
        default=None, alias="async"
    )


class FunctionCallOutputItem(_Strict):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[
            list[Annotated[InputText | RefusedContent, Field(discriminator="type")]],
            Tag("list"),
            Field(max_length=MAX_INPUT_ITEMS),
        ],
        _TEXT_OR_LIST,
    ]
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    status: Status | None = None
    name: str | None = Field(default=None, max_length=64)
    namespace: _Namespace = None
    caller: _Caller = None


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """A model's reasoning sent back: accepted, and not rendered (``_NOT_RENDERED``)."""

    type: Literal["reasoning"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[
        str | None,
        _refused("reasoning is never handed out encrypted here; chain with previous_response_id"),
    ] = None
    status: Status | None = None


class RefusedItem(_Refused):
    type: Literal[
        "item_reference",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "web_search_call",
        "tool_search_call",
        "tool_search_output",
        "additional_tools",
        "configuration_update",
        "compaction",
        "compaction_trigger",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "program",
        "program_output",
    ]
    _what = "input item"
    _why = (
        "input here is messages, function calls and their outputs, and reasoning; item "
        "references are not resolved (send previous_response_id), and the other items are "
        "built-in tools', which run inside OpenAI's platform"
    )


_ITEM_TAGS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_REFUSED_ITEM_TYPES = frozenset(typing.get_args(RefusedItem.model_fields["type"].annotation))


def _item_kind(value: Any) -> str | None:
    """Which model reads an input item: by its ``type`` ("message" when absent, as OpenAI's
    easy input message has none); a documented type this gateway refuses goes to
    ``RefusedItem``, anything else to no model (a 400 naming the tags)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    if kind in _ITEM_TAGS:
        return kind
    return "refused" if kind in _REFUSED_ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[RefusedItem, Tag("refused")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an input item's type is message (the default), function_call, "
        "function_call_output or reasoning",
    ),
]


# ---- tools, tool choice, text format, reasoning -------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: Annotated[
        bool | None, _only(False, "every tool is offered in the prompt; tool search is OpenAI's")
    ] = None
    allowed_callers: Annotated[
        list[Literal["direct", "programmatic"]] | None,
        _refused(
            "programmatic tool calling is OpenAI's; the model calls functions directly here",
            lambda callers: callers is None or set(callers) <= {"direct"},
        ),
    ] = None
    output_schema: Annotated[
        dict[str, Any] | None,
        _refused("the chat template has no place for a function's output schema"),
    ] = None
    async_: Annotated[bool | None, _only(False, "calls are answered in turn here")] = Field(
        default=None, alias="async"
    )

    @field_validator("parameters")
    @classmethod
    def _schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            check_json_schema(parameters, "tools.parameters")
        return parameters


class RefusedTool(_Refused):
    type: Literal[
        "file_search",
        "computer",
        "computer_use_preview",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "mcp",
        "code_interpreter",
        "programmatic_tool_calling",
        "image_generation",
        "local_shell",
        "shell",
        "custom",
        "namespace",
        "tool_search",
        "apply_patch",
    ]
    _what = "tool"
    _why = _BUILT_IN


Tool = Annotated[FunctionTool | RefusedTool, Field(discriminator="type")]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class RefusedChoice(_Refused):
    type: Literal[
        "allowed_tools",
        "file_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "computer",
        "computer_use_preview",
        "computer_use",
        "image_generation",
        "code_interpreter",
        "mcp",
        "custom",
        "apply_patch",
        "shell",
        "programmatic_tool_calling",
    ]
    _what = "tool_choice"
    _why = (
        "only function tools are served here (give 'none', 'auto', 'required' or a function; "
        "offer only the tools the model may call)"
    )


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[FunctionChoice | RefusedChoice, Field(discriminator="type")]
)


class FormatText(_Strict):
    type: Literal["text"]


class FormatJSONObject(_Strict):
    type: Literal["json_object"]


class FormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(schema, "text.format.schema")
        return schema


class TextConfig(_Strict):
    format: (
        Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]
        | None
    ) = None
    verbosity: Annotated[
        Literal["low", "medium", "high"] | None, _refused("this model has no verbosity control")
    ] = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Annotated[
        Literal["auto", "concise", "detailed"] | None,
        Ignored("the reasoning is returned as its own text (reasoning_text), never summarised"),
    ] = None
    generate_summary: Annotated[
        Literal["auto", "concise", "detailed"] | None,
        Ignored("the reasoning is returned as its own text (reasoning_text), never summarised"),
    ] = None
    mode: Annotated[str | None, _refused("this model has one reasoning mode")] = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: Annotated[
        bool | None, Ignored("no padding is added to stream events here")
    ] = None


# ---- the request ----------------------------------------------------------------------------

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDE_REFUSED = {
    "reasoning.encrypted_content": "reasoning is never handed out encrypted here; it is kept "
    "with the stored response (chain with previous_response_id)",
    "message.input_image.image_url": _TEXT_ONLY,
    "computer_call_output.output.image_url": _BUILT_IN,
    "file_search_call.results": _BUILT_IN,
    "web_search_call.results": _BUILT_IN,
    "web_search_call.action.sources": _BUILT_IN,
    "code_interpreter_call.outputs": _BUILT_IN,
}


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: every field of OpenAI's ``ResponseCreateParams``, honoured,
    accepted without effect (``Ignored``) or refused for a reason; SGLang's sampling extras
    as its own Responses server takes them. An explicit ``null`` means "not given"."""

    model: str = Field(min_length=1)
    input: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[list[InputItem], Tag("list"), Field(min_length=1, max_length=MAX_INPUT_ITEMS)],
        _TEXT_OR_LIST,
    ]
    instructions: str | None = None
    max_output_tokens: int | None = FIELD_BOUNDS["max_completion_tokens"].field()
    temperature: float | None = FIELD_BOUNDS["temperature"].field()
    top_p: float | None = FIELD_BOUNDS["top_p"].field()
    top_logprobs: int | None = FIELD_BOUNDS["top_logprobs"].field()
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | (
        None
    ) = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    include: list[str] | None = Field(default=None, max_length=16)
    truncation: Annotated[
        Literal["auto", "disabled"] | None,
        _refused(
            "the input is never truncated here: an input too long for the model is a 400 "
            "naming the limit (truncation 'disabled')",
            lambda value: value != "auto",
        ),
    ] = None
    service_tier: Annotated[
        Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None,
        _refused(
            "there is one service tier here (its share of a pair is the tenant's policy)",
            lambda value: value in (None, "auto", "default"),
        ),
    ] = None
    safety_identifier: Annotated[
        str | None, Ignored("the audit log names the tenant and key of every request")
    ] = Field(default=None, max_length=256)
    prompt_cache_key: Annotated[str | None, Ignored(_PREFIX_CACHE)] = Field(
        default=None, max_length=1024
    )
    prompt_cache_retention: Annotated[
        Literal["in_memory", "24h"] | None, Ignored(_PREFIX_CACHE)
    ] = None
    prompt_cache_options: Annotated[dict[str, Any] | None, Ignored(_PREFIX_CACHE)] = None
    max_tool_calls: Annotated[
        int | None,
        Ignored(
            "it bounds calls of built-in tools, and none run here; function calls are the "
            "client's to run"
        ),
    ] = Field(default=None, ge=1)
    background: Annotated[
        bool | None,
        _only(
            False, "a response is generated while its request is open; there is no background queue"
        ),
    ] = None
    background_options: Annotated[
        dict[str, Any] | None, _refused("there is no background queue here")
    ] = None
    conversation: Annotated[str | dict[str, Any] | None, _refused(_CONVERSATIONS)] = None
    context_management: Annotated[
        list[dict[str, Any]] | None, _refused("the context is never compacted here")
    ] = None
    prompt: Annotated[
        dict[str, Any] | None,
        _refused("prompt templates are stored in OpenAI's platform; send the input itself"),
    ] = None
    moderation: Annotated[dict[str, Any] | None, _refused("there is no moderation model here")] = (
        None
    )
    image: Annotated[dict[str, Any] | None, _refused(_TEXT_ONLY)] = None
    access_programs: Annotated[
        dict[str, Any] | None, _refused("there are no access programs here")
    ] = None

    # SGLang's Responses extras (its ``ResponsesRequest``): sampling fields and template
    # variables, honoured as on chat completions.
    top_k: int | None = FIELD_BOUNDS["top_k"].field()
    min_p: float | None = FIELD_BOUNDS["min_p"].field()
    repetition_penalty: float | None = FIELD_BOUNDS["repetition_penalty"].field()
    frequency_penalty: float | None = FIELD_BOUNDS["frequency_penalty"].field()
    presence_penalty: float | None = FIELD_BOUNDS["presence_penalty"].field()
    seed: int | None = FIELD_BOUNDS["seed"].field()
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_TEMPLATE_KWARGS
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded_first(cls, raw: Any) -> Any:
        """The cheap bounds before validation reads a single item (as ``protocol.check_counts``
        for chat): the items' count, and the shape of every JSON schema (``schema_shape``)."""
        if not isinstance(raw, dict):
            return raw
        given = raw.get("input")
        if isinstance(given, list) and len(given) > MAX_INPUT_ITEMS:
            raise bad_request(
                f"Invalid value for 'input': at most {MAX_INPUT_ITEMS} items per request.",
                code="invalid_value",
                param="input",
            )
        check_schema_shapes(raw, _raw_schemas)
        return raw

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return stop

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        for value in include or ():
            if value == LOGPROBS_INCLUDE:
                continue
            reason = _INCLUDE_REFUSED.get(value)
            if reason is None:
                raise ValueError(f"unknown include value {value[:64]!r}")
            raise _refuse(f"include {value!r}", reason)
        return include

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def stored(self) -> bool:
        """``store`` defaults to true, as OpenAI's."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def _raw_schemas(raw: dict[str, Any], tools: Any) -> Iterator[tuple[str, Any]]:
    """Every JSON schema a Responses body carries, where it is (wrong shapes are validation's)."""
    text = raw.get("text")
    format_ = text.get("format") if isinstance(text, dict) else None
    if isinstance(format_, dict):
        yield "text.format.schema", format_.get("schema")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict):
            yield f"tools.{index}.parameters", tool.get("parameters")


# ---- items in their canonical form --------------------------------------------------------


def new_item_id(prefix: str) -> str:
    """An output or input item's id: random, unique across responses."""
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(
    role: str,
    text_parts: Iterable[str],
    status: Status = "completed",
    id: str | None = None,
    logprobs: Logprobs | None = None,
) -> dict[str, Any]:
    """A message as OpenAI lists it: an assistant's with ``output_text`` parts (one, with its
    log probabilities, when it is an answer), anyone else's with ``input_text`` parts."""
    if role == "assistant":
        content = [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
            for text in text_parts
        ]
    else:
        content = [{"type": "input_text", "text": text} for text in text_parts]
    return {
        "id": id or new_item_id("msg"),
        "type": "message",
        "role": role,
        "status": status,
        "content": content,
    }


def call_item(
    call_id: str, name: str, arguments: str, status: Status = "completed", id: str | None = None
) -> dict[str, Any]:
    return {
        "id": id or new_item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def call_output_item(call_id: str, output: str, id: str | None = None) -> dict[str, Any]:
    return {
        "id": id or new_item_id("fco"),
        "type": "function_call_output",
        "call_id": call_id,
        "output": output,
        "status": "completed",
    }


def reasoning_item(
    text: str, status: Status = "completed", id: str | None = None
) -> dict[str, Any]:
    return {
        "id": id or new_item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def canonical_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items in the canonical form (a string is one user message)."""
    given = request.input
    if isinstance(given, str):
        return [message_item("user", [given])]
    items: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageItem):
            content = item.content
            texts = (
                [content]
                if isinstance(content, str)
                else [part.text for part in content if isinstance(part, InputText | OutputText)]
            )
            items.append(message_item(item.role, texts, id=item.id))
        elif isinstance(item, FunctionCallItem):
            items.append(call_item(item.call_id, item.name, item.arguments, id=item.id))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            if not isinstance(output, str):
                output = "".join(part.text for part in output if isinstance(part, InputText))
            items.append(call_output_item(item.call_id, output, id=item.id))
        elif isinstance(item, ReasoningItem):
            kept = reasoning_item("".join(part.text for part in item.content or ()), id=item.id)
            kept["summary"] = [part.model_dump() for part in item.summary]
            items.append(kept)
    return items


def as_context(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as a later turn's context: without their log probabilities,
    which ``chat_messages`` never reads (stored with the response already, they doubled what a
    long answer stores)."""
    return [_without_logprobs(item) if item["type"] == "message" else item for item in output]


def _without_logprobs(message: dict[str, Any]) -> dict[str, Any]:
    parts = [
        {**part, "logprobs": []} if "logprobs" in part else part for part in message["content"]
    ]
    return {**message, "content": parts}


def chat_messages(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical items as chat messages: a message as itself, calls on the assistant turn
    before them (a turn of their own when there is none), each output a tool message, and
    reasoning not at all (``_NOT_RENDERED``)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            texts = [part["text"] for part in item["content"]]
            content: str | list[dict[str, str]] = (
                texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
            )
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


# ---- the chat request it becomes ----------------------------------------------------------

# Fields passed to the chat request under the same name.
_SAME_NAMED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "user",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "metadata",
)


def chat_request(
    request: ResponsesRequest, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request the core serves: the instructions as the system turn, then the stored
    ``context`` (what ``previous_response_id`` brings in) and this request's ``items``; the
    sampling fields, tools and output format as chat's.

    Every field but the messages is parsed as any chat request's (its checks across fields
    included). The messages are built from items already validated (this request's, by
    ``ResponsesRequest``; the context, by the request that stored it) into the shapes a chat
    message must have, and not validated a second time: a large input was parsed off the event
    loop (``gateway.server.intake``), and is not walked again on it."""
    turns = []
    if request.instructions is not None:
        turns.append({"role": "system", "content": request.instructions})
    turns += chat_messages([*context, *items])
    if len(turns) > MAX_MESSAGES:
        raise too_many_messages()
    chat: dict[str, Any] = {"model": request.model, "messages": [{"role": "user", "content": ""}]}
    if request.stream:
        chat["stream"] = True
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    for name in _SAME_NAMED:
        value = getattr(request, name)
        if value is not None:
            chat[name] = value
    if request.reasoning is not None and request.reasoning.effort is not None:
        chat["reasoning_effort"] = request.reasoning.effort
    tools = [_chat_tool(tool) for tool in request.tools or () if isinstance(tool, FunctionTool)]
    if tools:
        chat["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None and (tools or choice != "auto"):  # "auto" with none: nothing
        chat["tool_choice"] = choice
    format_ = request.text.format if request.text is not None else None
    if isinstance(format_, FormatJSONObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(format_, FormatJSONSchema):
        schema: dict[str, Any] = {"name": format_.name, "schema": format_.schema_}
        if format_.description is not None:
            schema["description"] = format_.description
        if format_.strict is not None:
            schema["strict"] = format_.strict
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if request.wants_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = request.top_logprobs or 0
    parsed: ChatCompletionRequest = parse_request(orjson.dumps(chat), ChatCompletionRequest)
    return parsed.model_copy(update={"messages": [_chat_message(turn) for turn in turns]})


def _chat_message(turn: dict[str, Any]) -> ChatMessage:
    """One turn of ``chat_messages`` as the chat request holds it (its shape is one a chat
    message may have: see ``chat_request``)."""
    fields = dict(turn)
    content = fields.get("content")
    if isinstance(content, list):
        fields["content"] = [TextPart.model_construct(type="text", text=p["text"]) for p in content]
    calls = fields.get("tool_calls")
    if calls is not None:
        fields["tool_calls"] = [
            ToolCallParam.model_construct(
                id=call["id"],
                type="function",
                function=FunctionCallParam.model_construct(**call["function"]),
            )
            for call in calls
        ]
    return ChatMessage.model_construct(**fields)


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def response_not_found(response_id: str) -> APIError:
    """The one answer for an id that names no response of this tenant: missing, expired,
    deleted and another tenant's read alike."""
    return APIError(
        404,
        f"No response found with id {response_id[:64]!r}.",
        "invalid_request_error",
        "response_not_found",
    )


# ---- the Response object ----------------------------------------------------------------


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # Written to the cache: every input token not read from it (SGLang's radix cache keeps each
    # prompt token its prefill computed).
    written = max(prompt_tokens - cached_tokens, 0)
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": written},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def text_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """A token's log probabilities as ``output_text.logprobs`` holds them."""
    return {
        "token": entry.token,
        "bytes": list(entry.token.encode()),
        "logprob": entry.logprob,
        "top_logprobs": [
            {"token": token, "bytes": list(token.encode()), "logprob": logprob}
            for token, logprob in entry.top
        ],
    }


def delta_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """The same, as a stream's ``output_text.delta`` carries them."""
    return [
        {
            "token": entry.token,
            "logprob": entry.logprob,
            "top_logprobs": [{"token": token, "logprob": logprob} for token, logprob in entry.top],
        }
        for entry in entries
    ]


def response_object(
    request: ResponsesRequest,
    *,
    id: str,
    created_at: int,
    status: Literal["in_progress", "completed", "incomplete", "failed"],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    completed_at: int | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object (``ResponseObject`` describes it), echoing the request's settings."""
    format_: dict[str, Any] = {"type": "text"}
    text = request.text.format if request.text is not None else None
    if text is not None:
        format_ = text.model_dump(by_alias=True, exclude_none=True)
    choice = request.tool_choice
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": None if status != "incomplete" else {"reason": incomplete_reason},
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": dict(request.metadata or {}),
        "model": request.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {
            "effort": request.reasoning.effort if request.reasoning else None,
            "summary": None,
        },
        "service_tier": "default",
        "store": request.stored,
        "temperature": request.temperature,
        "text": {"format": format_},
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        "tools": [
            tool.model_dump(include={"type", "name", "description", "parameters", "strict"})
            for tool in request.tools or ()
        ],
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
        "background": False,
    }


def finish_status(finish_reason: str) -> tuple[Literal["completed", "incomplete"], str | None]:
    """A response's status and incomplete reason from its generation's finish reason: cut at
    ``max_output_tokens`` (or ended by an operator's abort) it is incomplete."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def input_item_page(
    items: list[dict[str, Any]], *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """One page of a response's input items, as ``GET .../input_items`` lists them (an
    ``after`` that names none of them is an empty page)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---- stream events ------------------------------------------------------------------------


class ResponseEvents:
    """A response's stream, as the SDKs parse it: each event's payload, numbered in order.

    ``created`` opens it; ``reasoning``, ``text`` and ``call`` add output as it is checked
    (each item is opened when its first part arrives and closed when another kind starts);
    ``closing`` closes the open item and ``finished`` ends the stream with
    ``response.completed`` (or ``response.incomplete``); ``failed`` ends it with ``error`` and
    ``response.failed``, nothing more of the open item. Items are built by the same functions
    as a whole answer's.
    """

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int) -> None:
        self._request = request
        self.id = response_id
        self.created_at = created_at
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self._open: dict[str, Any] | None = None  # the item being written
        self._open_text = ""
        # The open message's log probabilities, written chunk by chunk.
        self._open_logprobs = JSONList()

    def _event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        # Joined, not added up: an event that ends a long answer with its log probabilities is
        # megabytes, and each + copied it whole once more.
        return b"".join((b"event: ", type_.encode(), b"\ndata: ", orjson.dumps(payload), b"\n\n"))

    def _response(self, status: Any, **fields: Any) -> dict[str, Any]:
        return response_object(
            self._request,
            id=self.id,
            created_at=self.created_at,
            status=status,
            output=list(self.output),
            **fields,
        )

    @property
    def _index(self) -> int:
        return len(self.output)

    def created(self) -> bytes:
        response = self._response("in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def reasoning(self, delta: str) -> bytes:
        if not delta:
            return b""
        out = b""
        if self._open is None or self._open["type"] != "reasoning":
            out += self._close()
            item = reasoning_item("", status="in_progress")
            item["content"] = []
            out += self._open_item(item)
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        assert self._open is not None
        self._open_text += delta
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=self._open["id"],
            output_index=self._index,
            content_index=0,
            delta=delta,
        )

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        if not delta and not logprobs:
            return b""
        out = b""
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            out += self._open_message()
        assert self._open is not None
        self._open_text += delta
        if logprobs and self._request.wants_logprobs:
            self._open_logprobs.add(orjson.dumps([text_logprob(e) for e in logprobs]))
        return out + self._event(
            "response.output_text.delta",
            item_id=self._open["id"],
            output_index=self._index,
            content_index=0,
            delta=delta,
            logprobs=delta_logprobs(logprobs or []) if self._request.wants_logprobs else [],
        )

    def call(self, name: str, arguments: str, call_id: str) -> bytes:
        out = self._close()
        item = call_item(call_id, name, "", status="in_progress")
        out += self._open_item(item)
        index = self._index
        out += self._event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=arguments,
        )
        out += self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=arguments,
        )
        done = call_item(call_id, name, arguments, id=item["id"])
        self._open = None
        return out + self._done(done)

    def closing(self, finish_reason: str) -> Iterator[bytes]:
        """The events that close the output, one at a time, each built when the one before it
        has been taken: three of them carry the message's log probabilities, megabytes for a
        long answer, and the caller lets the loop run between two."""
        status, _ = finish_status(finish_reason)
        if not self.output and self._open is None:
            yield self._open_message()  # an empty answer is still a message, as whole
        yield from self._closing(status)

    def finished(
        self, finish_reason: str, usage: dict[str, Any], completed_at: int
    ) -> tuple[dict[str, Any], bytes]:
        """The final Response, once ``closing`` has closed the output, and the event that ends
        the stream with it."""
        assert self._open is None, "closing() first"
        status, reason = finish_status(finish_reason)
        response = self._response(
            status, usage=usage, completed_at=completed_at, incomplete_reason=reason
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return response, self._event(kind, response=response)

    def failed(self, error: APIError) -> bytes:
        """The end of a stream that failed: what was sent of the open item stays incomplete."""
        if self._open is not None:
            self.output.append(self._closed_item("incomplete"))
            self._open = None
        out = self._event("error", code=error.code, message=error.message, param=error.param)
        response = self._response(
            "failed", error={"code": "server_error", "message": error.message}
        )
        return out + self._event("response.failed", response=response)

    # -- items ---------------------------------------------------------------------------

    def _open_item(self, item: dict[str, Any]) -> bytes:
        self._open, self._open_text, self._open_logprobs = item, "", JSONList()
        return self._event("response.output_item.added", output_index=self._index, item=item)

    def _open_message(self) -> bytes:
        item = message_item("assistant", [], status="in_progress")
        out = self._open_item(item)
        return out + self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._index,
            content_index=0,
            part=_output_text("", []),
        )

    def _closed_item(self, status: Status, logprobs: Logprobs | None = None) -> dict[str, Any]:
        open_ = self._open
        assert open_ is not None
        if open_["type"] == "reasoning":
            return reasoning_item(self._open_text, status, id=open_["id"])
        if logprobs is None:
            logprobs = self._open_logprobs.fragment()
        return message_item(
            "assistant", [self._open_text], status, id=open_["id"], logprobs=logprobs
        )

    def _close(self, status: Status = "completed") -> bytes:
        """The events that close the open item, together: another item opens after them."""
        return b"".join(self._closing(status))

    def _closing(self, status: Status) -> Iterator[bytes]:
        open_ = self._open
        if open_ is None:
            return
        item_id, index, text = open_["id"], self._index, self._open_text
        logprobs = None
        if open_["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            yield self._event(
                "response.reasoning_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
            )
        else:
            logprobs = self._open_logprobs.fragment()  # written once, sent twice
            part = _output_text(text, logprobs)
            yield self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
        yield self._event(
            "response.content_part.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=part,
        )
        done = self._closed_item(status, logprobs)
        self._open = None
        yield self._done(done)

    def _done(self, item: dict[str, Any]) -> bytes:
        index = self._index
        self.output.append(item)
        return self._event("response.output_item.done", output_index=index, item=item)


def _output_text(text: str, logprobs: Logprobs) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def output_items(
    text: str,
    reasoning: str | None,
    calls: Iterable[tuple[str, str, str]],
    status: Status,
    logprobs: Logprobs | None = None,
) -> list[dict[str, Any]]:
    """A whole answer's output: its reasoning, its text (none when it only calls functions)
    with its ``logprobs`` (``text_logprob``'s of each token), then each call
    ``(call_id, name, arguments)``; as a stream closes the same items."""
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(reasoning, status))
    calls = list(calls)
    if text or not calls:
        items.append(message_item("assistant", [text], status, logprobs=logprobs))
    items += [call_item(call_id, name, arguments) for call_id, name, arguments in calls]
    return items


# ---- answer models ------------------------------------------------------------------------
#
# As ``protocol``'s response models: the builders above return plain dicts; these describe
# exactly what they return, for the OpenAPI document and for tests that validate every
# builder's output with them (strict, no field missing or extra).


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class AnswerInputText(_Answer):
    type: Literal["input_text"]
    text: str


class AnswerTopLogprob(_Answer):
    token: str
    bytes: list[int]
    logprob: float = Field(le=0)


class AnswerLogprob(_Answer):
    token: str
    bytes: list[int]
    logprob: float = Field(le=0)
    top_logprobs: list[AnswerTopLogprob]


class AnswerOutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(max_length=0)
    logprobs: list[AnswerLogprob] = Field(
        description="With include 'message.output_text.logprobs'; else empty."
    )


class AnswerMessage(_Answer):
    """A message: an answer (role assistant, output_text) or an input message."""

    id: str
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    status: Status
    content: list[Annotated[AnswerInputText | AnswerOutputText, Field(discriminator="type")]]


class AnswerFunctionCall(_Answer):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    status: Status


class AnswerFunctionCallOutput(_Answer):
    id: str
    type: Literal["function_call_output"]
    call_id: str
    output: str
    status: Literal["completed"]


class AnswerReasoning(_Answer):
    """The model's reasoning, as its reasoning parser read it (never summarised)."""

    id: str
    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: list[ReasoningText]
    status: Status


OutputItem = Annotated[
    AnswerMessage | AnswerFunctionCall | AnswerReasoning, Field(discriminator="type")
]
ListedItem = Annotated[
    AnswerMessage | AnswerFunctionCall | AnswerFunctionCallOutput | AnswerReasoning,
    Field(discriminator="type"),
]


class InputTokensDetails(_Answer):
    cached_tokens: int = Field(ge=0)
    cache_write_tokens: int = Field(ge=0, description="Input tokens not read from the cache.")


class OutputTokensDetails(_Answer):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(_Answer):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class ResponseErrorInfo(_Answer):
    code: Literal["server_error"]
    message: str


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"] | None


class AnswerFunctionTool(_Answer):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class AnswerTextConfig(_Answer):
    format: Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]


class AnswerReasoningConfig(_Answer):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None
    summary: None


# response_object()
class ResponseObject(_Answer):
    """A response: as created, answered, stored and retrieved (``/v1/responses``)."""

    id: str = Field(description="The response's id: its generation ID and audit key.")
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None
    error: ResponseErrorInfo | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: AnswerReasoningConfig
    service_tier: Literal["default"]
    store: bool
    temperature: float | None
    text: AnswerTextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[AnswerFunctionTool]
    top_logprobs: int | None
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    background: Literal[False]


# input_item_page()
class ResponseItemList(_Answer):
    """A page of a stored response's input items."""

    object: Literal["list"]
    data: list[ListedItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


# deleted()
class ResponseDeleted(_Answer):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]
