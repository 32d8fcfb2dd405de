"""A tight asyncio HTTP/1.1 load client (raw sockets, ``httptools``) that times the first body
byte (TTFT) and the whole answer over keep-alive connections in closed loop, which ``wrk``
cannot; section 1's ``direct`` row bounds what it can measure. Asked to (``token_gaps``), it
also times the gaps between a stream's events that carry text, as a client reading them sees
them: tokens a router held back and wrote together arrive in one read, a gap of about 0."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import orjson

CLIENT_ERRORS = (ConnectionError, OSError, httptools.HttpParserError)


@dataclass(frozen=True)
class Target:
    url: str  # http://host:port/path
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    # Give every request its own ``rid`` (the JSON body is re-encoded per request): real SGLang
    # with engine_patch binds prefill and decode by rid when the gateway's tags are absent.
    fresh_rid: bool = False
    token_gaps: bool = False  # time the gaps between streamed events that carry text

    def request_bytes(self) -> bytes:
        body = self.body
        if self.fresh_rid:
            body = orjson.dumps(dict(orjson.loads(body), rid=uuid.uuid4().hex))
        parts = urlsplit(self.url)
        head = f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers)
        return (head + "\r\n").encode() + body


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    status: int
    ok: bool = True  # 200 and no error object: an engine failing after the head answers 200 too
    token_gaps_s: tuple[float, ...] = ()  # between the stream's events that carry text


def described(values: dict) -> str:
    """A result as one line of the bench's progress log."""
    return ", ".join(
        f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
    )


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    def summary(self) -> dict[str, float]:
        ok = self.ok()
        ttft, total = sorted(s.ttft_s for s in ok), sorted(s.total_s for s in ok)
        figures = {"requests": len(ok), "non_200": len(self.samples) - len(ok) + self.errors}
        figures["rps"] = len(ok) / self.wall_s if self.wall_s else 0.0
        for name, values in (("ttft", ttft), ("total", total)):
            for q in (50, 99):
                figures[f"{name}_p{q}_ms"] = percentile(values, q / 100) * 1000
        gaps = sorted(gap for s in ok for gap in s.token_gaps_s)
        if gaps:
            figures["gap_p50_ms"] = percentile(gaps, 0.5) * 1000
            figures["gap_mean_ms"], figures["gaps_together_pct"] = gap_spread(gaps)
        return figures


TOGETHER_S = 0.0001  # a gap this short is the same read, not a decode step


def gap_spread(gaps: Sequence[float]) -> tuple[float, float]:
    """The mean of some gaps between tokens (seconds) in ms, and the share of them in % that
    were text read together with the text before it: held back, then written together (by the
    engine, when it made both in one step, or by a router). ``gaps`` must not be empty."""
    together = sum(1 for gap in gaps if gap < TOGETHER_S)
    return sum(gaps) / len(gaps) * 1000, 100 * together / len(gaps)


def carries_text(event: bytes) -> bool:
    """Whether one SSE event is a completions or chat chunk with text in it."""
    if not event.startswith(b"data: {"):
        return False
    choice = (orjson.loads(event[6:]).get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


class _Response:
    """httptools callbacks for one response: when its body began, whether it is complete,
    whether it carries an error object and, with ``token_gaps``, when each event with text
    arrived."""

    def __init__(self, token_gaps: bool = False) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.first_body_at: float | None = None
        self.complete = self.error = self.keep_alive = False
        self._tail = b""
        self._events: bytes | None = b"" if token_gaps else None  # the incomplete last event
        self.text_at: list[float] = []

    def on_body(self, body: bytes) -> None:
        self.first_body_at = self.first_body_at or time.perf_counter()
        self.error |= b'"error"' in self._tail + body[:16] or b'"error"' in body  # also split
        self._tail = body[-16:]
        if self._events is not None:
            now = time.perf_counter()
            *events, self._events = (self._events + body).split(b"\n\n")
            self.text_at += [now for event in events if carries_text(event.strip())]

    def token_gaps(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.text_at, self.text_at[1:], strict=False))

    def on_message_complete(self) -> None:
        self.complete = True
        # Read now: once the message is complete the parser forgets its framing, and asked
        # later it answers False for every response (a new connection per request).
        self.keep_alive = self.parser.should_keep_alive()


class Connection:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, raw: bytes, token_gaps: bool = False) -> Sample:
        """Send one request; return when the whole response has arrived."""
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )
        response = _Response(token_gaps)
        started = time.perf_counter()
        self.writer.write(raw)
        while not response.complete:
            data = await self.reader.read(1 << 18)
            if not data:
                raise ConnectionError("server closed the connection")
            response.parser.feed_data(data)
        ended = time.perf_counter()
        if not response.keep_alive:
            await self.close()
        status = response.parser.get_status_code()
        ok = status == 200 and not response.error
        ttft = (response.first_body_at or ended) - started
        return Sample(ttft, ended - started, status, ok, response.token_gaps())

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def run_load(
    target: Target,
    *,
    concurrency: int,
    duration_s: float | None = None,
    total_requests: int | None = None,
    warmup_requests: int = 0,
) -> RunResult:
    """``concurrency`` connections in closed loop, for a duration or a number of requests."""
    result = RunResult()
    connections = [Connection(target.url) for _ in range(concurrency)]
    for connection in connections:
        for _ in range(warmup_requests):
            await connection.exchange(target.request_bytes(), target.token_gaps)
    remaining = [total_requests if total_requests is not None else 1 << 62]
    deadline = time.perf_counter() + duration_s if duration_s is not None else float("inf")

    async def worker(connection: Connection) -> None:
        while remaining[0] > 0 and time.perf_counter() < deadline:
            remaining[0] -= 1
            try:
                sample = await connection.exchange(target.request_bytes(), target.token_gaps)
                result.samples.append(sample)
            except CLIENT_ERRORS:
                result.errors += 1
                await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    result.wall_s = time.perf_counter() - started
    for connection in connections:
        await connection.close()
    return result


async def run_pd_direct(
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    body: dict,
    *,
    concurrency: int,
    total_requests: int,
    path: str = "/v1/completions",
    token_gaps: bool = False,
) -> RunResult:
    """No router: each request to a prefill and a decode worker at once, as a PD router sends it
    (``token_gaps``: decode's stream timed as ``Target.token_gaps`` times a router's)."""
    result = RunResult()
    remaining = [total_requests]

    async def worker() -> None:
        prefill, decode = Connection(prefill_url), Connection(decode_url)
        while remaining[0] > 0:
            remaining[0] -= 1
            # One rid on both sides: engine_patch binds the pair by it (as a router would have to).
            host, room = urlsplit(prefill_url).hostname, random.getrandbits(63)
            pd = {"bootstrap_host": host, "bootstrap_port": bootstrap_port, "bootstrap_room": room}
            raw_body = orjson.dumps({**body, **pd, "rid": uuid.uuid4().hex})
            pre_raw = Target(prefill_url + path, raw_body).request_bytes()
            dec_raw = Target(decode_url + path, raw_body).request_bytes()
            started = time.perf_counter()
            try:
                pre, dec = await asyncio.gather(
                    prefill.exchange(pre_raw), decode.exchange(dec_raw, token_gaps)
                )
            except CLIENT_ERRORS:
                result.errors += 1
                await asyncio.gather(prefill.close(), decode.close())
                continue
            # Both sends start together: decode's first byte is the client's TTFT, the later of
            # the two answers ends the request.
            total = time.perf_counter() - started
            status = dec.status if pre.status == 200 else pre.status
            ok = pre.ok and dec.ok
            result.samples.append(Sample(dec.ttft_s, total, status, ok, dec.token_gaps_s))
        await asyncio.gather(prefill.close(), decode.close())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result
