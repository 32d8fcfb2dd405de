"""A Responses stream from the core's checked stream (``responses_api.sse_events``): the model
family's reasoning becomes a reasoning item before the answer's message, a call its own item,
and the response is stored before its last event goes out (a store that fails ends the stream
with the failure, not with ``response.completed``); a whole answer the same way.

Decode's chunks are fed to ``core.generation.CheckedStream`` with the model's output parser, as
``test_stream_usage_and_cuts`` does for chat.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import types
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from gateway.api import responses_api
from gateway.common.errors import APIError
from gateway.core.generation import (
    CheckedStream,
    Choice,
    ChoiceStreams,
    Completion,
    OutputShaper,
    StreamEnd,
    StreamStep,
    Trace,
)
from gateway.openai import protocol
from gateway.openai.responses import (
    LOGPROBS_INCLUDE,
    ResponseEvents,
    ResponsesRequest,
    as_context,
    canonical_items,
    text_logprob,
)
from gateway.tool_parsers import Function, OutputParser, ToolCall
from gateway.verification.verify import Expectation, NoScanner, StreamGuard
from gateway.workers.dispatch import EngineRequest
from tests.loop_turns import items_with_turns

GID = "gen_01JTESTTESTTESTTESTTESTTES"
EXPECTED = Expectation(GID, "acme", prompt_tokens=3, max_tokens=16, require_tags=False)
STOP = {"type": "stop", "matched": 2}


def chunk(text: str, tokens: int, finish: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {
        "id": GID,
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "finish_reason": finish,
    }
    return {"text": text, "meta_info": meta}


async def batches_of(*batches: list[dict[str, Any]]) -> AsyncGenerator[list[dict[str, Any]]]:
    for batch in batches:
        yield batch


class Saved:
    """The response store's ``save``, recording what it was given (or failing)."""

    def __init__(self, fails: bool = False) -> None:
        self.records: list[Any] = []
        self.fails = fails

    def __call__(self, record: Any) -> None:
        if self.fails:
            raise OSError("database gone")
        self.records.append(record)


def components(saved: Saved) -> Any:
    policy = types.SimpleNamespace(response_retention_days=30)
    return types.SimpleNamespace(
        responses=types.SimpleNamespace(save=saved),
        policies=types.SimpleNamespace(tenant=lambda tenant_id: policy),
    )


def call_of(**fields: Any) -> responses_api.ResponsesCall:
    request: ResponsesRequest = protocol.parse_request(
        orjson.dumps({"model": "m", "input": "Hi", **fields}), ResponsesRequest
    )
    created = datetime.now(UTC)
    return responses_api.ResponsesCall(
        request,
        "acme",
        canonical_items(request),
        [],
        None,  # type: ignore[arg-type]  # the chat request: not read after the core's part
        ResponseEvents(request, GID, int(created.timestamp())),
        created,
    )


def reasoning_shaper() -> OutputShaper:
    parser = OutputParser(
        reasoning="qwen3",
        tool_format="qwen25",
        functions={"get_weather": Function("get_weather", {"type": "object"})},
    )
    return OutputShaper(parser, NoScanner(), "acme")


def stream(call: responses_api.ResponsesCall, saved: Saved, chunks: list[Any]) -> list[Any]:
    trace = Trace(GID, datetime.now(UTC), time.perf_counter(), stream=True, model="m")
    request = EngineRequest(
        generation_id=GID, tenant_id="acme", input_ids=[1, 2, 3], sampling_params={}, cache_salt="s"
    )

    async def collect() -> list[bytes]:
        checked = CheckedStream(
            Choice(0, 0, request, EXPECTED),
            batches_of(*[[c] for c in chunks[1:]]),
            StreamGuard(NoScanner(), "acme"),
            None,
            reasoning_shaper(),
            engine_repeats_output=True,
        )
        checked.take_first([chunks[0]])
        streams = ChoiceStreams([checked], trace, None)
        writes = []
        async for write in responses_api.sse_events(components(saved), call, streams):
            writes.append(write)
            if saved.records:
                writes.append(b"<stored>")
        return writes

    writes = asyncio.run(collect())
    out: list[Any] = []
    for write in writes:
        if write == b"<stored>":
            out.append("<stored>")
            continue
        out += [
            orjson.loads(block.split(b"\n")[1].removeprefix(b"data: "))
            for block in write.strip().split(b"\n\n")
        ]
    return out


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Decode's text is the whole output so far in every chunk.
PARTS = ["<think>Paris", " is in France.</think>", "Let me look.", CALL]
CHUNKS = [
    chunk("".join(PARTS[: n + 1]), n + 1, STOP if n == len(PARTS) - 1 else None)
    for n in range(len(PARTS))
]


def test_reasoning_text_and_calls_become_items_in_order_and_the_response_is_stored_first() -> None:
    saved = Saved()
    events = stream(call_of(), saved, CHUNKS)
    # Stored before the last write was handed out, and not before the one ahead of it.
    assert events.count("<stored>") == 1 and events.pop() == "<stored>"
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [
        "reasoning",
        "message",
        "function_call",
    ]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning.strip() == "Paris is in France."
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text.strip() == "Let me look."
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [item["type"] for item in final["response"]["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    (record,) = saved.records
    stored = orjson.loads(orjson.dumps(record.response))  # as the store writes it
    assert stored == final["response"] and record.tenant_id == "acme"
    # The conversation a follow-up continues: this input, then this output.
    context = orjson.loads(orjson.dumps(record.context))
    assert context == [*record.input_items, *as_context(final["response"]["output"])]


def test_store_false_keeps_nothing() -> None:
    saved = Saved()
    events = stream(call_of(store=False), saved, CHUNKS)
    assert (
        "<stored>" not in events
        and events[-1]["type"] == "response.completed"
        and saved.records == []
    )


def test_a_store_that_fails_ends_the_stream_with_the_failure_not_completed() -> None:
    with pytest.raises(APIError) as failed:
        stream(call_of(), Saved(fails=True), CHUNKS)
    assert failed.value.status == 503 and failed.value.code == "store_unavailable"


def test_a_whole_answer_is_the_same_items_and_is_stored() -> None:
    saved = Saved()
    call = call_of()
    completion = Completion(
        0,
        "Let me look.",
        "tool_calls",
        3,
        9,
        0,
        reasoning="Paris is in France.",
        tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')],
    )
    trace = Trace(GID, datetime.now(UTC), time.perf_counter(), model="m")
    response = asyncio.run(responses_api.answer(components(saved), call, trace, completion))
    assert [item["type"] for item in response["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert response["status"] == "completed" and response["id"] == GID
    assert saved.records[0].response == response


class ScriptedStreams:
    """Checked steps as the core hands them out, without a stream behind them."""

    def __init__(self, items: list[StreamStep | StreamEnd]) -> None:
        self.items = items
        self.prompt_tokens = 3

    async def events(self) -> AsyncGenerator[tuple[None, StreamStep | StreamEnd]]:
        for item in self.items:
            yield None, item


def test_the_events_that_close_a_long_answer_go_out_one_at_a_time_the_loop_free_between() -> None:
    # Three of them carry the message's log probabilities: megabytes at the end of a long
    # answer, which other tenants waited for while they were all written in one go.
    call = call_of(stream=True, top_logprobs=2, include=[LOGPROBS_INCLUDE])
    entries = [protocol.TokenLogprob(f"t{n}", -0.5, [("a", -1.0), ("b", -2.0)]) for n in range(6)]
    steps: list[StreamStep | StreamEnd] = [
        StreamStep(entry.token, {}, [entry]) for entry in entries
    ]
    steps.append(StreamEnd("", "stop", len(entries), 0, None))
    saved = Saved()

    writes = items_with_turns(
        responses_api.sse_events(components(saved), call, ScriptedStreams(steps))  # type: ignore[arg-type]
    )
    closing = [(orjson.loads(write.split(b"\ndata: ")[1]), turns) for write, turns in writes[-4:]]
    assert [event["type"] for event, _ in closing] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]  # each its own write
    seen = [turns for _, turns in closing]
    assert all(later > earlier for earlier, later in itertools.pairwise(seen))
    expected = [text_logprob(entry) for entry in entries]
    part, item, completed = (event for event, _ in closing[1:])
    assert part["part"]["logprobs"] == expected
    assert item["item"]["content"][0]["logprobs"] == expected
    assert completed["response"]["output"][0]["content"][0]["logprobs"] == expected
    assert saved.records and saved.records[0].response["id"] == GID
