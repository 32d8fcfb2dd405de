"""What a stream's events carry: usage on every chunk with ``continuous_usage_stats`` (as vLLM and
SGLang send it: the choice's tokens so far), a constrained call cut short by ``max_tokens``
ended with ``finish_reason`` "length" and the unfinished call as text (not an isolation
alarm), and reasoning held whole until it ends with ``stream_reasoning`` false.

Decode's chunks are fed to ``core.generation.CheckedStream`` and the events read from
``api.answers.sse_events``, as ``test_stream_batches`` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.api.answers import Kind, sse_events
from gateway.core.generation import CheckedStream, Choice, ChoiceStreams, OutputShaper, Trace
from gateway.tool_parsers import Function, OutputParser
from gateway.verification.verify import Expectation, NoScanner, StreamGuard
from gateway.workers.dispatch import EngineRequest

GID = "gen_01JTESTTESTTESTTESTTESTTES"
EXPECTED = Expectation(GID, "acme", prompt_tokens=3, max_tokens=8, require_tags=False)
FUNCTIONS = {"get_weather": Function("get_weather", {"type": "object"})}


def chunk(text: str, tokens: int, finish: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {
        "id": GID,
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "cached_tokens": 2,
        "finish_reason": finish,
    }
    return {"text": text, "meta_info": meta}


async def batches_of(*batches: list[dict[str, Any]]) -> AsyncGenerator[list[dict[str, Any]]]:
    for batch in batches:
        yield batch


def events(
    kind: Kind,
    chunks: list[dict[str, Any]],
    *,
    continuous: bool = False,
    shaper: OutputShaper | None = None,
) -> list[Any]:
    """Every event ``sse_events`` sends for decode's ``chunks`` (one batch each)."""
    trace = Trace(GID, datetime.now(UTC), time.perf_counter(), stream=True, model="m")
    request = EngineRequest(
        generation_id=GID, tenant_id="acme", input_ids=[1, 2, 3], sampling_params={}, cache_salt="s"
    )

    async def collect() -> bytes:
        guard = StreamGuard(NoScanner(), "acme")
        later = [[c] for c in chunks[1:]]
        stream = CheckedStream(
            Choice(0, 0, request, EXPECTED),
            batches_of(*later),
            guard,
            None,
            shaper,
            engine_repeats_output=True,
        )
        stream.take_first([chunks[0]])
        streams = ChoiceStreams([stream], trace, None)
        out = b""
        async for write in sse_events(trace, streams, kind, True, continuous):
            out += write
        return out

    written = asyncio.run(collect())
    payloads = [part[len(b"data: ") :] for part in written.split(b"\n\n") if part]
    return [p.decode() if p == b"[DONE]" else orjson.loads(p) for p in payloads]


LENGTH = {"type": "length", "length": 3}
TEXT = [chunk("He", 1), chunk("Hell", 2), chunk("Hello", 3, LENGTH)]


def test_with_continuous_usage_every_chunk_carries_the_choices_usage_so_far() -> None:
    for kind in ("chat", "completion"):
        sent = events(kind, TEXT, continuous=True)
        chunks, usage_chunk = [e for e in sent[:-2] if e["choices"]], sent[-2]
        assert chunks and all("usage" in e for e in chunks)
        counts = [e["usage"]["completion_tokens"] for e in chunks]
        assert counts == sorted(counts) and counts[-1] == 3
        assert all(e["usage"]["prompt_tokens"] == 3 for e in chunks)
        assert chunks[-1]["usage"]["total_tokens"] == 6
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        # include_usage's last chunk is unchanged: the whole request's usage, no choices.
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3
        assert sent[-1] == "[DONE]"


def test_without_it_only_the_last_chunk_carries_usage() -> None:
    sent = events("chat", TEXT)
    assert [e for e in sent[:-1] if "usage" in e] == [sent[-2]]


def constrained() -> OutputShaper:
    parser = OutputParser(reasoning=None, tool_format=None, functions=FUNCTIONS, constrained=True)
    return OutputShaper(parser, NoScanner(), "acme")


def test_a_streamed_call_cut_by_max_tokens_ends_with_length_and_the_call_as_text() -> None:
    cut = '[{"name": "get_weather", "parameters": {"city": "Pa'
    sent = events(
        "chat",
        [chunk(cut[:10], 2), chunk(cut, 8, {"type": "length", "length": 8})],
        shaper=constrained(),
    )
    assert sent[-1] == "[DONE]" and all("error" not in e for e in sent[:-1])
    deltas = [e["choices"][0] for e in sent[:-2]]
    assert deltas[-1]["finish_reason"] == "length"
    assert "".join(d["delta"].get("content", "") for d in deltas) == cut
    assert not any("tool_calls" in d["delta"] for d in deltas)


def test_a_streamed_calls_complete_calls_go_out_before_the_cut() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    text = f"[{one}, " + '{"name": "get_w'
    sent = events(
        "chat", [chunk(text[:30], 4), chunk(text, 8, {"type": "length"})], shaper=constrained()
    )
    deltas = [e["choices"][0]["delta"] for e in sent[:-2]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(d.get("content", "") for d in deltas) == '{"name": "get_w'
    assert sent[-3]["choices"][0]["finish_reason"] == "length"


def test_held_reasoning_goes_out_whole_once_the_answer_begins() -> None:
    def shaper(stream_reasoning: bool) -> OutputShaper:
        parser = OutputParser(reasoning="deepseek-r1", tool_format=None, functions={})
        return OutputShaper(parser, NoScanner(), "acme", stream_reasoning)

    chunks = [
        chunk("I think", 1),
        chunk("I think about it", 2),
        chunk("I think about it</think>Paris", 3),
        chunk("I think about it</think>Paris.", 4, LENGTH),
    ]
    for streamed in (True, False):
        sent = events("chat", chunks, shaper=shaper(streamed))
        deltas = [e["choices"][0]["delta"] for e in sent if isinstance(e, dict) and e["choices"]]
        pieces = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        assert "".join(pieces) == "I think about it"
        assert "".join(d.get("content", "") for d in deltas) == "Paris."
        if streamed:
            assert len(pieces) > 1  # as it comes
        else:
            assert len(pieces) == 1  # whole, once the answer began
