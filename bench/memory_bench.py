"""Section 4: gateway resident memory at idle and with N concurrent streams held open.

The streams go to model ``tiny-llama-slow``, whose decode backend (an instant backend in
slow mode) sends one chunk every 2 s: each client connection reads its first chunk and then
keeps reading, so every stream stays open through the gateway (client socket, ASGI task,
engine stream to decode, prefill answer, claims) while RSS is read from /proc.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx
import orjson

from bench.processes import rss_bytes
from bench.rig import SLOW_MODEL, Rig
from bench.routing_bench import PROMPT
from bench.stream_client import Target


@dataclass
class MemoryResult:
    idle_fresh_mb: float  # just after start and one request
    idle_before_mb: float  # after the other sections, before opening streams
    streams: list[dict]  # {"streams": N, "opened": k, "rss_mb": ..., "open_s": ...}
    idle_after_mb: float  # streams closed
    per_1000_streams_mb: float | None
    # Engine streams the gateway still held open to the decode backend once every client had
    # closed its stream, and how long it took to get there (at most 30 s is waited).
    upstream_open_after_close: int
    upstream_release_s: float


class HeldStream:
    """One client stream: send, wait for the first body bytes, then keep draining."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.first = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        host, port = self.target.url.split("//")[1].split("/")[0].split(":")
        try:
            reader, self.writer = await asyncio.open_connection(host, int(port))
            self.writer.write(self.target.request_bytes())
            head = await reader.readuntil(b"\r\n\r\n")
            ok = head.startswith(b"HTTP/1.1 200")
            if ok:
                await reader.read(1)  # the first body byte: the stream is flowing
            if not self.first.done():
                self.first.set_result(ok)
            while await reader.read(65536):
                pass
        except (OSError, asyncio.IncompleteReadError) as exc:
            if not self.first.done():
                self.first.set_exception(exc)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.task is not None:
            self.task.cancel()


def _mb(pid: int) -> float:
    return rss_bytes(pid) / 1e6


def streams_in_progress(port: int) -> int:
    """The slow streams the decode backend at ``port`` is still sending (its own count: the
    gateway's connections to it also carry aborts, then stay open idle in its pool)."""
    answer = httpx.get(f"http://127.0.0.1:{port}/bench/streams", timeout=5.0)
    answer.raise_for_status()
    return int(answer.json()["in_progress"])


async def _hold(rig: Rig, counts: tuple[int, ...], log) -> tuple[list[dict], float]:
    body = orjson.dumps({"model": SLOW_MODEL, "prompt": PROMPT, "max_tokens": 1024, "stream": True})
    target = Target(
        rig.gateway_url + "/v1/completions", body, (("Authorization", f"Bearer {rig.gateway_key}"),)
    )
    held: list[HeldStream] = []
    rows = []
    try:
        for count in counts:
            started = time.perf_counter()
            batch = []
            while len(held) < count:
                stream = HeldStream(target)
                stream.task = asyncio.create_task(stream.run())
                held.append(stream)
                batch.append(stream)
                if len(batch) % 100 == 0:
                    await asyncio.sleep(0.05)  # open in waves: no SYN flood against the backlog
            results = await asyncio.gather(*(s.first for s in batch), return_exceptions=True)
            opened = sum(
                1 for s in held if s.first.done() and not s.first.exception() and s.first.result()
            )
            open_s = time.perf_counter() - started
            await asyncio.sleep(2.0)  # let buffers and the allocator settle
            row = {
                "streams": count,
                "opened": opened,
                "rss_mb": _mb(rig.gateway_pid),
                "open_s": open_s,
                "failed": sum(1 for r in results if r is not True),
            }
            rows.append(row)
            log(
                f"  {count} streams held ({opened} flowing, opened in {open_s:.1f} s): "
                f"gateway RSS {row['rss_mb']:.0f} MB"
            )
    finally:
        for stream in held:
            stream.close()
        await asyncio.sleep(0.5)
    return rows, 0.0


def run_memory_bench(rig: Rig, idle_fresh_mb: float, log=print) -> MemoryResult:
    idle_before = _mb(rig.gateway_pid)
    log(
        f"  idle: {idle_fresh_mb:.0f} MB just after start, "
        f"{idle_before:.0f} MB after the other sections"
    )
    rows, _ = asyncio.run(_hold(rig, rig.config.streams, log))
    assert rig.slow_decode.port is not None
    closed_at = time.monotonic()
    upstream_open = streams_in_progress(rig.slow_decode.port)
    while upstream_open > 5 and time.monotonic() - closed_at < 30:
        time.sleep(0.5)
        upstream_open = streams_in_progress(rig.slow_decode.port)
    release_s = time.monotonic() - closed_at
    time.sleep(max(0.0, 3.0 - release_s))
    idle_after = _mb(rig.gateway_pid)
    log(
        f"  after closing them: {idle_after:.0f} MB; engine streams still open "
        f"{release_s:.1f} s after the clients left: {upstream_open}"
    )
    # Streams the gateway still pulls would load it during the next sections: end them from
    # the engine side (the slow backend is not used again).
    rig.slow_decode.stop()
    time.sleep(2.0)
    per_1000 = None
    if rows:
        per_1000 = (rows[0]["rss_mb"] - idle_before) / rows[0]["streams"] * 1000
        if len(rows) > 1:  # the slope between the two largest counts, free of one-time growth
            a, b = rows[-2], rows[-1]
            per_1000 = (b["rss_mb"] - a["rss_mb"]) / (b["streams"] - a["streams"]) * 1000
    return MemoryResult(
        idle_fresh_mb, idle_before, rows, idle_after, per_1000, upstream_open, release_s
    )


def memory_as_json(result: MemoryResult) -> dict:
    return asdict(result)
