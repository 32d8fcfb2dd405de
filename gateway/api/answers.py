"""The OpenAI answer, built from the core's completions: one JSON body, or the SSE events of a
stream.

The request schemas stay in ``gateway.openai.protocol``; what is answered is assembled here,
in one place, from what the core verified: choices, tool calls, log probabilities, usage and
the system fingerprint, whole or chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Literal

import orjson

from gateway.common.json_turns import JSONList, in_turns, json_in_turns
from gateway.core.generation import (
    ChoiceStreams,
    Completion,
    StreamEnd,
    StreamStep,
    Trace,
    positions_per_turn,
)
from gateway.openai.protocol import (
    CompletionRequest,
    PromptLogprobs,
    TokenLogprob,
    TokenLogprobs,
    now,
)
from gateway.openai.tokenize import ModelTokenizer
from gateway.openai.tool_use import new_tool_call_id
from gateway.tool_parsers import ToolCall

# "responses": a Responses API request, served as chat (``gateway.api.responses_api``).
Kind = Literal["chat", "completion", "responses"]


async def echoed(
    parsed: CompletionRequest, completions: list[Completion], tokenizer: ModelTokenizer
) -> list[Completion]:
    """``echo``: each choice's text after its prompt's; with ``max_tokens`` 0, the prompt
    alone (the token generated anyway is dropped)."""
    prompts = parsed.prompts()
    texts = [
        prompt
        if isinstance(prompt, str)
        else await tokenizer.decode(prompt, skip_special_tokens=False)
        for prompt in prompts
    ]
    score_only = parsed.max_tokens == 0
    echoed = []
    for c in completions:
        prompt_text = texts[c.prompt_index]
        if score_only:
            c = dataclasses.replace(
                c,
                text="",
                finish_reason="length",
                completion_tokens=0,
                logprobs=None if c.logprobs is None else [],
            )
        echoed.append(dataclasses.replace(c, text=prompt_text + c.text))
    return echoed


async def whole_answer(
    kind: Kind,
    trace: Trace,
    model: str,
    fingerprint: str,
    completions: list[Completion],
    generated: list[Completion],
) -> dict[str, Any]:
    """The whole answer: ``completions`` as choices, usage of all that was ``generated``
    (with ``best_of``, the candidates not returned count too, as in OpenAI's API). Their log
    probabilities are written a slice at a time (``json_in_turns``)."""
    if len(generated) == 1:
        only = generated[0]
        usage = usage_of(only.prompt_tokens, only.completion_tokens, only.cached_tokens)
    else:
        completions = sorted(completions, key=lambda c: c.index)
        usage = usage_of(
            sum(c.prompt_tokens for c in generated),
            sum(c.completion_tokens for c in generated),
            sum(c.cached_tokens for c in generated),
        )
    created = now()
    if kind == "chat":
        chat_choices = [
            chat_choice(
                c.index,
                c.text,
                c.finish_reason,
                None if c.logprobs is None else await whole_chat_logprobs(c.logprobs),
                c.reasoning,
                _calls(c.tool_calls),
            )
            for c in completions
        ]
        return chat_completion(
            trace.generation_id, model, created, chat_choices, usage, fingerprint
        )
    choices = [
        completion_choice(
            c.index,
            c.text,
            c.finish_reason,
            None
            if c.logprobs is None
            else await whole_completion_logprobs(c.logprobs, c.prompt_logprobs),
        )
        for c in completions
    ]
    return completion(trace.generation_id, model, created, choices, usage, fingerprint)


def per_turn(entries: Sequence[TokenLogprob]) -> int:
    """How many of ``entries`` are written between two turns of the loop."""
    return positions_per_turn(len(entries[0].top) if entries else 0)


def _calls(calls: list[ToolCall] | None) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [tool_call(new_tool_call_id(), c.name, c.arguments) for c in calls]


async def sse_events(
    trace: Trace,
    streams: ChoiceStreams,
    kind: Kind,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncGenerator[bytes]:
    """The client's SSE events, written together when they are ready together: what is checked
    goes out before the next wait on decode, the end of the stream with its last text.

    ``continuous_usage`` (``stream_options.continuous_usage_stats``, vLLM's and SGLang's): every
    chunk carries its choice's usage so far, as theirs do; the last usage chunk is unchanged."""
    model, gid, created = trace.model or "", trace.generation_id, now()
    offsets: dict[int, int] = {}  # characters sent per choice (completions' text_offset)
    calls_sent: dict[int, int] = {}  # tool calls sent per choice
    # Per choice: its prompt's tokens, and its completion and cached tokens so far.
    progress: dict[int, tuple[int, int, int]] = {
        stream.index: (stream.choice.expected.prompt_tokens, 0, 0) for stream in streams.streams
    }

    def sse_chunk(chunk: dict[str, Any], index: int) -> bytes:
        if continuous_usage:
            chunk["usage"] = usage_of(*progress[index])
        return sse_event(chunk)

    def content(
        index: int,
        delta: str,
        logprobs: Sequence[TokenLogprob] | None,
        reasoning: str = "",
        calls: list[ToolCall] | None = None,
    ) -> bytes:
        if kind == "chat":
            if reasoning or calls:
                return _chat_fields(index, delta, logprobs, reasoning, calls or [])
            chunk = chat_chunk(gid, model, created, {"content": delta}, None, index, logprobs)
        else:
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(delta)
            chunk = completion_chunk(gid, model, created, delta, None, index, logprobs, offset)
        return sse_chunk(chunk, index)

    def _chat_fields(
        index: int,
        delta: str,
        logprobs: Sequence[TokenLogprob] | None,
        reasoning: str,
        calls: list[ToolCall],
    ) -> bytes:
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if delta:
            fields["content"] = delta
        out = []
        if fields or logprobs:
            out.append(
                sse_chunk(chat_chunk(gid, model, created, fields, None, index, logprobs), index)
            )
        for call in calls:
            number = calls_sent.get(index, 0)
            calls_sent[index] = number + 1
            for piece in tool_call_deltas(number, new_tool_call_id(), call.name, call.arguments):
                if "id" not in piece:
                    piece = {"index": number, "function": piece["function"]}
                chunk = chat_chunk(gid, model, created, {"tool_calls": [piece]}, None, index)
                out.append(sse_chunk(chunk, index))
        return b"".join(out)

    events: list[bytes] = []
    if kind == "chat":
        role = {"role": "assistant", "content": ""}
        for stream in streams.streams:
            chunk = chat_chunk(gid, model, created, role, None, stream.index)
            events.append(sse_chunk(chunk, stream.index))
    ended: list[StreamEnd] = []
    async for stream, item in streams.events():
        index = stream.index
        if continuous_usage:
            prompt_tokens = progress[index][0]
            progress[index] = (prompt_tokens, *_so_far(item))
        if isinstance(item, StreamEnd):
            ended.append(item)
            if item.tail or item.logprobs or item.reasoning or item.tool_calls:
                events.append(
                    content(index, item.tail, item.logprobs, item.reasoning, item.tool_calls)
                )
            if kind == "chat":
                chunk = chat_chunk(gid, model, created, {}, item.finish_reason, index)
            else:
                chunk = completion_chunk(gid, model, created, "", item.finish_reason, index)
            events.append(sse_chunk(chunk, index))
            continue
        if item.pieces is not None and not continuous_usage:  # checked as one, sent as cut
            events += [content(index, piece, None) for piece in item.pieces]
        elif item.delta or item.logprobs or item.reasoning or item.tool_calls:
            events.append(
                content(index, item.delta, item.logprobs, item.reasoning, item.tool_calls)
            )
        # After the chunk that carries the finish reason only that choice's end follows, so
        # its text waits for it and both go out in one write.
        if events and not item.finished:
            yield b"".join(events)
            events = []
    if include_usage:
        usage = usage_of(
            streams.prompt_tokens,
            sum(end.completion_tokens for end in ended),
            sum(end.cached_tokens for end in ended),
        )
        object_ = "chat.completion.chunk" if kind == "chat" else "text_completion"
        events.append(sse_event(usage_chunk(gid, model, created, object_, usage)))
    events.append(b"data: [DONE]\n\n")
    yield b"".join(events)


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _so_far(item: StreamStep | StreamEnd) -> tuple[int, int]:
    """A choice's completion and cached tokens as of a step (the engine's running counts,
    checked with the step) or its end."""
    if isinstance(item, StreamEnd):
        return item.completion_tokens, item.cached_tokens
    return item.meta.get("completion_tokens", 0), item.meta.get("cached_tokens", 0)


# ---- the answer's parts, as OpenAI's API writes them -----------------------------------


@functools.lru_cache(maxsize=256)  # a few models, asked on every answer: hashed once each
def system_fingerprint(model: str, tokenizer: str) -> str:
    """What OpenAI calls the backend configuration: here, the model and its tokenizer."""
    return "fp_" + hashlib.sha256(f"{model}\0{tokenizer}".encode()).hexdigest()[:12]


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def chat_completion(
    id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any],
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str,
    logprobs: dict[str, Any] | None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
        if not text.strip():
            message["content"] = None  # as OpenAI answers a turn that only calls tools
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def tool_call(id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_deltas(index: int, id: str, name: str, arguments: str) -> list[dict[str, Any]]:
    """A call in a stream, as OpenAI streams one: its id and name first (empty arguments),
    then its arguments."""
    return [
        {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}},
        {"index": index, "function": {"arguments": arguments}},
    ]


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A stream chunk's log probabilities (a whole answer's: ``whole_chat_logprobs``)."""
    return {"content": [chat_logprob(entry) for entry in entries], "refusal": None}


async def whole_chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = await json_in_turns(entries, chat_logprob, per_turn(entries))
    return {"content": content, "refusal": None}


def chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode()),
        "top_logprobs": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode())}
            for token, logprob in entry.top
        ],
    }


def completion(
    id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any],
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage_,
    }


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# The legacy completions format: four lists, one item per token each.
_COLUMNS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def completion_logprobs(
    entries: Sequence[TokenLogprob], text_offset: int, prompt: PromptLogprobs | None = None
) -> dict[str, list[Any]]:
    """The legacy completions format; ``text_offset`` is where the first token's text starts.
    With an echoed ``prompt``, its tokens come first (the first without a log probability,
    as in OpenAI's API) and the offsets count from the prompt's start."""
    columns: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
    if prompt is not None:
        _add_unscored(columns, prompt.first_token)
        text_offset = len(prompt.first_token)
        entries = [*prompt.rest, *entries]
    _add_scored(columns, entries, text_offset)
    return columns


async def whole_completion_logprobs(
    entries: Sequence[TokenLogprob], prompt: PromptLogprobs | None
) -> dict[str, Any]:
    """``completion_logprobs`` of a whole answer (from its first character), its columns
    written a slice of tokens at a time with the loop free between two (``in_turns``)."""
    written = {name: JSONList() for name in _COLUMNS}

    def write(part: dict[str, list[Any]]) -> None:
        for name, values in part.items():
            written[name].add(orjson.dumps(values))

    text_offset = 0
    if prompt is not None:
        entries = TokenLogprobs.of(prompt.rest, entries)
        text_offset = len(prompt.first_token)
        head: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
        _add_unscored(head, prompt.first_token)
        write(head)
    async for positions in in_turns(len(entries), per_turn(entries)):
        part: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
        text_offset = _add_scored(part, entries[positions.start : positions.stop], text_offset)
        write(part)
    return {name: column.fragment() for name, column in written.items()}


def _add_unscored(columns: dict[str, list[Any]], token: str) -> None:
    columns["tokens"].append(token)
    columns["token_logprobs"].append(None)
    columns["top_logprobs"].append(None)
    columns["text_offset"].append(0)


def _add_scored(
    columns: dict[str, list[Any]], entries: Sequence[TokenLogprob], text_offset: int
) -> int:
    """``entries`` added to ``columns``, the first starting at ``text_offset``; the offset
    after the last."""
    tokens, token_logprobs = columns["tokens"], columns["token_logprobs"]
    top_logprobs, offsets = columns["top_logprobs"], columns["text_offset"]
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(dict(entry.top))
    return text_offset


def chat_chunk(
    id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    index: int = 0,
    logprobs: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        ],
    }


def completion_chunk(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    index: int = 0,
    logprobs: Sequence[TokenLogprob] | None = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            completion_choice(
                index,
                text,
                finish_reason,
                None if logprobs is None else completion_logprobs(logprobs, text_offset),
            )
        ],
    }


def usage_chunk(
    id: str, model: str, created: int, object_: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }
