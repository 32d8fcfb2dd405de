"""How the pipeline turns decode's stream into SSE writes when chunks arrive together.

``api.answers.sse_events`` receives decode's chunks in batches (those that arrived in one
read), checked by ``core.generation.CheckedStream``, and yields the bytes of one client write
at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from gateway.api.answers import sse_events
from gateway.core.generation import CheckedStream, Choice, ChoiceStreams, Trace
from gateway.verification.verify import Expectation, IsolationFailure, NoScanner, StreamGuard
from gateway.workers.dispatch import EngineRequest

GID = "gen_01JTESTTESTTESTTESTTESTTES"
EXPECTED = Expectation(GID, "acme", prompt_tokens=3, max_tokens=8, require_tags=False)


def chunk(text: str, tokens: int, finish: str | None = None, *, gid: str = GID) -> dict[str, Any]:
    meta = {
        "id": gid,
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "finish_reason": {"type": finish} if finish else None,
    }
    return {"text": text, "meta_info": meta}


async def batches_of(*batches: list[dict[str, Any]]) -> AsyncGenerator[list[dict[str, Any]]]:
    for batch in batches:
        yield batch


def writes_of(
    first: dict[str, Any], *later: list[dict[str, Any]], repeated: bool = True
) -> tuple[list[bytes], BaseException | None]:
    """The writes ``sse_events`` makes for a stream whose first chunk was ``first``, and what it
    raised; each chunk the whole text so far (``repeated``, SGLang's default) or what it adds."""
    guard = StreamGuard(NoScanner(), "acme")
    trace = Trace(GID, datetime.now(UTC), time.perf_counter(), stream=True, model="m")
    request = EngineRequest(
        generation_id=GID,
        tenant_id="acme",
        input_ids=[1, 2, 3],
        sampling_params={},
        cache_salt="salt",
    )

    async def collect() -> tuple[list[bytes], BaseException | None]:
        writes: list[bytes] = []
        try:
            stream = CheckedStream(
                Choice(0, 0, request, EXPECTED),
                batches_of(*later),
                guard,
                None,
                engine_repeats_output=repeated,
            )
            stream.take_first([first])
            streams = ChoiceStreams([stream], trace, None)
            async for write in sse_events(trace, streams, "completion", False):
                writes.append(write)
        except IsolationFailure as failure:
            return writes, failure
        return writes, None

    return asyncio.run(collect())


def texts(write: bytes) -> list[str]:
    events = [part[len(b"data: ") :] for part in write.split(b"\n\n") if part]
    return [orjson.loads(e)["choices"][0]["text"] for e in events if e != b"[DONE]"]


def test_chunks_that_arrive_together_are_one_write_with_an_event_per_engine_chunk() -> None:
    # As the engine (and a byte-forwarding router) sends them: a client counting events per
    # token sees the same stream through the gateway.
    writes, failure = writes_of(
        chunk("He", 1), [chunk("Hell", 2), chunk("Hello", 3)], [chunk("Hello!", 4, "stop")]
    )
    assert failure is None
    assert texts(writes[0]) == ["He"]
    assert texts(writes[1]) == ["ll", "o"]  # two engine chunks, checked as one
    assert len(writes) == 3


def test_chunks_of_an_incremental_engine_that_arrive_together_are_one_write_an_event_each() -> None:
    writes, failure = writes_of(
        chunk("He", 1), [chunk("ll", 2), chunk("o", 3)], [chunk("!", 4, "stop")], repeated=False
    )
    assert failure is None
    assert [texts(write) for write in writes] == [["He"], ["ll", "o"], ["!", ""]]


def test_a_chunk_that_adds_no_text_gives_no_event() -> None:
    writes, _ = writes_of(chunk("He", 1), [chunk("He", 2), chunk("Hey", 3)], [chunk("Hey", 4)])
    assert texts(writes[1]) == ["y"]


def test_the_last_text_goes_out_with_the_end_of_the_stream() -> None:
    writes, _ = writes_of(chunk("He", 1), [chunk("Hello", 2, "length")])
    assert texts(writes[-1]) == ["llo", ""]  # the last delta and the finish event
    assert writes[-1].endswith(b"data: [DONE]\n\n")
    assert len(writes) == 2


def test_a_failed_check_withholds_the_whole_batch_it_arrived_in() -> None:
    writes, failure = writes_of(
        chunk("He", 1), [chunk("Hello", 2), chunk("Hello, other tenant", 3, gid="gen_x")]
    )
    assert isinstance(failure, IsolationFailure) and "generation ID" in failure.reason
    assert [texts(write) for write in writes] == [
        ["He"]
    ]  # nothing of the batch, not even its good chunk


def test_text_rewritten_inside_a_batch_is_refused() -> None:
    writes, failure = writes_of(chunk("He", 1), [chunk("Hello", 2), chunk("Help me", 3)])
    assert isinstance(failure, IsolationFailure) and "rewritten" in failure.reason
    assert len(writes) == 1


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_one_chunk_stream_is_a_single_write(finish: str) -> None:
    writes, failure = writes_of(chunk("Hi", 1, finish))
    assert failure is None and len(writes) == 1
    assert texts(writes[0]) == ["Hi", ""] and writes[0].endswith(b"data: [DONE]\n\n")
