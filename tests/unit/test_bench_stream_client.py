"""The bench's stream client keeps its connection while the server keeps it, as the clients it
stands for do, and times the gaps between streamed text as a client reads it: text written
together is one read (a gap of about 0), an event split across writes is timed when it is
whole, and events without text (the finish chunk, usage, ``[DONE]``) are not tokens.
``bench_serving``'s own gaps are read the same way."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.serving_bench import itl_spread
from bench.stream_client import Connection, RunResult, Sample, carries_text

PAUSE_S = 0.05


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One streamed answer: "a", a pause, "b" and "c" in one write, a pause, "d" cut in two
    writes, a pause, the finish chunk (no text) and ``[DONE]``."""
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)  # the request's body, "{}"
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(_event("a")))
    await writer.drain()
    await asyncio.sleep(PAUSE_S)
    writer.write(_chunk(_event("b") + _event("c")))
    await writer.drain()
    await asyncio.sleep(PAUSE_S)
    d = _event("d")
    writer.write(_chunk(d[:10]))
    await writer.drain()
    await asyncio.sleep(PAUSE_S)
    writer.write(_chunk(d[10:]))
    await writer.drain()
    await asyncio.sleep(PAUSE_S)
    writer.write(_chunk(_event("") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _gaps() -> tuple[float, ...]:
    server = await asyncio.start_server(_serve_stream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Connection(f"http://127.0.0.1:{port}")
    try:
        request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        sample = await connection.exchange(request, token_gaps=True)
    finally:
        await connection.close()
        server.close()
        await server.wait_closed()
    assert sample.ok
    return sample.token_gaps_s


def test_text_written_together_is_a_gap_of_zero_and_a_split_event_counts_once_whole() -> None:
    gaps = asyncio.run(_gaps())
    assert len(gaps) == 3  # a, b, c, d: the finish chunk and [DONE] carry no text
    after_a, after_b, after_c = gaps
    assert after_a >= PAUSE_S * 0.8
    assert after_b < 0.001  # c arrived in b's read
    assert after_c >= 2 * PAUSE_S * 0.8  # d counts when its second half arrived


def test_the_summary_reports_the_share_of_gaps_that_were_one_read() -> None:
    result = RunResult(wall_s=1.0)
    result.samples.append(Sample(0.01, 0.1, 200, True, (0.002, 0.0, 0.002, 0.0)))
    summary = result.summary()
    assert summary["gaps_together_pct"] == 50.0
    assert summary["gap_mean_ms"] == 1.0
    assert "gap_p50_ms" not in RunResult(wall_s=1.0).summary()  # plain answers: no gap figures


def test_only_chunks_with_text_are_tokens() -> None:
    assert carries_text(_event("x").strip())
    assert not carries_text(_event("").strip())
    assert carries_text(b'data: {"choices": [{"delta": {"content": "x"}}]}')
    assert not carries_text(b'data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert not carries_text(b"data: [DONE]")


def test_bench_serving_gaps_give_their_mean_and_the_share_written_together() -> None:
    spread = itl_spread([[0.003, 0.00002], [0.002, 0.001]])
    assert spread["itl_together_pct"] == 25.0
    assert spread["mean_itl_ms"] == pytest.approx(1.505)
    assert itl_spread([]) == {"mean_itl_ms": None, "itl_together_pct": None}


async def _exchanges(close_after: bool) -> tuple[int, int]:
    """Three exchanges on one client connection: (connections the server saw, requests)."""
    connections = requests = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, requests
        connections += 1
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
            except asyncio.IncompleteReadError:
                break
            requests += 1
            close = b"connection: close\r\n" if close_after else b""
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + close + b"\r\n{}")
            await writer.drain()
            if close_after:
                break
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    connection = Connection(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        for _ in range(3):
            sample = await connection.exchange(
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            )
            assert sample.ok
    finally:
        await connection.close()
        server.close()
        await server.wait_closed()
    return connections, requests


def test_the_client_keeps_its_connection_while_the_server_keeps_it() -> None:
    assert asyncio.run(_exchanges(close_after=False)) == (1, 3)


def test_the_client_opens_a_new_connection_after_the_server_says_close() -> None:
    assert asyncio.run(_exchanges(close_after=True)) == (3, 3)
