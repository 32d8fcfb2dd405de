"""Section 4: gateway RSS at idle and with N streams held open through it (model
``tiny-llama-slow``: one chunk every 2 s), then how many engine streams the gateway still pulls
once the clients have gone (the slow decode backend's own count)."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson

from bench.processes import rss_bytes
from bench.rig import SLOW_MODEL, Rig
from bench.routing_bench import PROMPT
from bench.stream_client import Target, described


async def _held_stream(target: Target, first: asyncio.Future[bool]) -> None:
    """One client stream: send, note whether the first body byte came, then keep draining."""
    host, port = target.url.split("//")[1].split("/")[0].split(":")
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(target.request_bytes())
        ok = (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        if ok:
            await reader.read(1)  # the first body byte: the stream is flowing
        first.set_result(ok)
        while await reader.read(65536):
            pass
    except (OSError, asyncio.IncompleteReadError) as exc:
        if not first.done():
            first.set_exception(exc)
    finally:
        if writer is not None:
            writer.close()


async def _hold(rig: Rig, log) -> list[dict]:
    body = {"model": SLOW_MODEL, "prompt": PROMPT, "max_tokens": 1024, "stream": True}
    auth = (("Authorization", f"Bearer {rig.gateway_key}"),)
    target = Target(rig.gateway_url + "/v1/completions", orjson.dumps(body), auth)
    loop = asyncio.get_running_loop()
    firsts: list[asyncio.Future[bool]] = []
    tasks: list[asyncio.Task] = []
    rows = []
    try:
        for count in rig.config.streams:
            started, batch = time.perf_counter(), len(firsts)
            while len(firsts) < count:
                firsts.append(loop.create_future())
                tasks.append(asyncio.create_task(_held_stream(target, firsts[-1])))
                if len(firsts) % 100 == 0:
                    await asyncio.sleep(0.05)  # open in waves: no SYN flood against the backlog
            results = await asyncio.gather(*firsts[batch:], return_exceptions=True)
            opened = sum(1 for f in firsts if not f.exception() and f.result())
            open_s = time.perf_counter() - started
            await asyncio.sleep(2.0)  # let buffers and the allocator settle
            row = {
                "streams": count, "opened": opened, "rss_mb": rss_bytes(rig.gateway_pid) / 1e6,
                "open_s": open_s, "failed": sum(1 for r in results if r is not True),
            }  # fmt: skip
            rows.append(row)
            log("  held: " + described(row))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.5)
    return rows


def streams_in_progress(port: int) -> int:
    """The slow streams the decode backend at ``port`` is still sending, by its own count."""
    answer = httpx.get(f"http://127.0.0.1:{port}/bench/streams", timeout=5.0)
    answer.raise_for_status()
    return int(answer.json()["in_progress"])


def run_memory_bench(rig: Rig, idle_fresh_mb: float, log=print) -> dict:
    idle_before = rss_bytes(rig.gateway_pid) / 1e6
    log(f"  idle: {idle_fresh_mb:.0f} MB after start, {idle_before:.0f} MB after other sections")
    rows = asyncio.run(_hold(rig, log))
    closed_at = time.monotonic()
    upstream_open = streams_in_progress(rig.slow_decode.port)
    while upstream_open > 5 and time.monotonic() - closed_at < 30:
        time.sleep(0.5)
        upstream_open = streams_in_progress(rig.slow_decode.port)
    release_s = time.monotonic() - closed_at
    time.sleep(max(0.0, 3.0 - release_s))
    idle_after = rss_bytes(rig.gateway_pid) / 1e6
    log(f"  closed: {idle_after:.0f} MB; engine streams open {release_s:.1f} s on: {upstream_open}")
    # Streams the gateway still pulls would load it during the next sections: end them from
    # the engine side (the slow backend is not used again).
    rig.slow_decode.stop()
    time.sleep(2.0)
    per_1000 = None
    if rows:  # with two counts, the slope between them: free of one-time growth
        low = rows[-2] if len(rows) > 1 else {"rss_mb": idle_before, "streams": 0}
        added = rows[-1]["rss_mb"] - low["rss_mb"]
        per_1000 = added / (rows[-1]["streams"] - low["streams"]) * 1000
    # idle_fresh: after start and one request; idle_before: after the other sections.
    return {
        "idle_fresh_mb": idle_fresh_mb, "idle_before_mb": idle_before, "streams": rows,
        "idle_after_mb": idle_after, "per_1000_streams_mb": per_1000,
        "upstream_open_after_close": upstream_open, "upstream_release_s": release_s,
    }  # fmt: skip
