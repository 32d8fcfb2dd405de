"""An instant SGLang-protocol backend: a stand-in worker that answers at once, for benchmarks.

It is NOT SGLang. It exists to measure what a router in front of SGLang costs by itself:
with a backend that does no work, everything above the direct-to-backend latency is the
router's. One process serves one role (prefill or decode), on a raw asyncio protocol with
the ``httptools`` parser (and uvloop when available), so it is not the bottleneck.

What it answers (shapes taken from real SGLang 0.5.23, ``tests/data``):
- ``GET /server_info`` (with ``"isogate_engine_patch": "instant-backend"``, so the gateway
  routes to it), ``/v1/loads``, ``/v1/models``, ``/health``, ``/health_generate``, and the
  other GET probes routers make (``/get_server_info``, ``/get_model_info``, ``/readiness``);
- ``POST /generate``: ``meta_info`` echoes ``id`` = ``rid``, ``prompt_tokens`` =
  ``len(input_ids)``, ``completion_tokens``, ``cached_tokens``, and the isolation tags from
  the ``X-Isolation-Tenant`` / ``X-Isolation-Generation`` headers as ``isolation_tenant`` /
  ``isolation_generation`` (what ``engine_patch`` does in the real engine); streams carry
  the cumulative text, as SGLang's do;
- ``POST /v1/completions`` and ``/v1/chat/completions`` in OpenAI shape (what a client sends
  straight to a worker, or what ``sglang_router`` forwards), streamed or not;
- ``GET /bench/streams``: ``{"in_progress": N}``, the slow streams still being sent (not
  SGLang's: what the memory bench asks once the clients have gone, where counting TCP
  connections would count a router's idle keep-alive connections too).

A stream sends ``--chunks`` chunks, ``--stream-interval-s`` apart (0: back to back), so the
same server also holds thousands of slow streams open for the gateway memory bench.

    python -m bench.instant_backend --role decode --port 34010 [--pool-tokens N] [--chunks 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import orjson

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
MARKER = "instant-backend"
TOKEN_TEXT = " tok"  # one "token" of output text
OUTPUT_TOKEN_ID = 56


@dataclass(frozen=True)
class BackendConfig:
    role: str
    pool_tokens: int
    chunks: int  # output tokens per request (also the number of stream chunks)
    stream_interval_s: float


def _static_bodies(config: BackendConfig) -> dict[bytes, bytes]:
    """The GET answers, serialised once: they never change."""
    info = json.loads((DATA / f"server_info_{config.role}.json").read_text())
    loads = json.loads((DATA / f"loads_{config.role}.json").read_text())
    internal = dict((info.get("internal_states") or [{}])[0])
    internal.update(
        max_total_num_tokens=config.pool_tokens,
        context_length=config.pool_tokens,
        max_req_input_len=config.pool_tokens - 1,
    )
    info.update(
        internal_states=[internal],
        context_length=config.pool_tokens,
        isogate_engine_patch=MARKER,
        disaggregation_mode=config.role,
    )
    loads["loads"] = [
        dict(loads["loads"][0], max_total_num_tokens=config.pool_tokens, num_used_tokens=0)
    ]
    models = {
        "object": "list",
        "data": [
            {
                "id": "instant-backend",
                "object": "model",
                "owned_by": "bench",
                "max_model_len": config.pool_tokens,
            }
        ],
    }
    info_body = orjson.dumps(info)
    return {
        b"/server_info": info_body,
        b"/get_server_info": info_body,
        b"/v1/loads": orjson.dumps(loads),
        b"/v1/models": orjson.dumps(models),
        b"/get_model_info": orjson.dumps({"model_path": "instant-backend", "is_generation": True}),
        b"/health": b"",
        b"/health_generate": b"",
        b"/readiness": b"",
        b"/liveness": b"",
    }


def _head(status: int, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    reason = b"OK" if status == 200 else b"Not Found" if status == 404 else b"Error"
    lines = [b"HTTP/1.1 %d %s" % (status, reason), b"content-type: " + content_type]
    lines.append(
        b"content-length: %d" % length if length is not None else b"transfer-encoding: chunked"
    )
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Request:
    __slots__ = ("body", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []


class SlowStreams:
    """The connections of one server that are sending a slow stream."""

    def __init__(self) -> None:
        self.in_progress: set[BackendProtocol] = set()

    def body(self) -> bytes:
        return orjson.dumps({"in_progress": len(self.in_progress)})


class BackendProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer each once it is complete."""

    def __init__(
        self, config: BackendConfig, statics: dict[bytes, bytes], slow_streams: SlowStreams
    ) -> None:
        self._config = config
        self._statics = statics
        self._slow_streams = slow_streams
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._request = Request()
        self._header_name = b""
        self._pending_chunk: asyncio.TimerHandle | None = None  # the next chunk of a slow stream

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close()
        except httptools.HttpParserError:
            self._write(_head(400, b"text/plain", 0, False))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pending_chunk is not None:
            self._pending_chunk.cancel()
        self._slow_streams.in_progress.discard(self)
        self._transport = None

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._request = Request()

    def on_url(self, url: bytes) -> None:
        self._request.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._request.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._request.body.append(body)

    def on_message_complete(self) -> None:
        request = self._request
        keep_alive = self._parser.should_keep_alive()
        path = request.url.split(b"?", 1)[0]
        method = self._parser.get_method()
        if method == b"GET":
            if path == b"/bench/streams":
                body: bytes | None = self._slow_streams.body()
            else:
                body = self._statics.get(path)
            if body is None:
                self._write(_head(404, b"application/json", 2, keep_alive) + b"{}")
            else:
                self._write(_head(200, b"application/json", len(body), keep_alive) + body)
        elif method == b"POST" and path in (
            b"/generate",
            b"/v1/completions",
            b"/v1/chat/completions",
        ):
            if self._generate(path, request, keep_alive):
                return  # a slow stream closes (if it must) when it ends
        else:
            self._write(_head(404, b"application/json", 2, keep_alive) + b"{}")
        if not keep_alive:
            self._close()

    # -- answers -----------------------------------------------------------------------------

    def _generate(self, path: bytes, request: Request, keep_alive: bool) -> bool:
        """Answer; True when the answer is a slow stream still in progress."""
        payload: dict[str, Any] = orjson.loads(b"".join(request.body)) if request.body else {}
        stream = bool(payload.get("stream"))
        if path == b"/generate":
            answer = SGLangAnswer(self._config, payload, request.headers)
        else:
            answer = OpenAIAnswer(self._config, payload, chat=path == b"/v1/chat/completions")
        if not stream:
            body = answer.whole()
            self._write(_head(200, b"application/json", len(body), keep_alive) + body)
            return False
        head = _head(200, b"text/event-stream", None, keep_alive)
        if self._config.stream_interval_s <= 0:  # one write: head, every chunk, the end
            self._write(head + b"".join(_chunk(event) for event in answer.events()) + b"0\r\n\r\n")
            return False
        self._write(head)
        events = iter(answer.events())
        loop = asyncio.get_running_loop()

        def send_next() -> None:
            if self._transport is None:
                return
            self._pending_chunk = None
            event = next(events, None)
            if event is None:
                self._slow_streams.in_progress.discard(self)
                self._write(b"0\r\n\r\n")
                if not keep_alive:
                    self._close()
                return
            self._write(_chunk(event))
            self._pending_chunk = loop.call_later(self._config.stream_interval_s, send_next)

        self._slow_streams.in_progress.add(self)
        send_next()
        return True

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class SGLangAnswer:
    """``/generate``: SGLang's native shape, with the tags engine_patch would echo."""

    def __init__(
        self, config: BackendConfig, payload: dict[str, Any], headers: dict[bytes, bytes]
    ) -> None:
        params = payload.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens") or config.chunks)
        self._completion = 1 if config.role == "prefill" else max(0, min(config.chunks, max_new))
        rid = payload.get("rid") or uuid.uuid4().hex
        input_ids = payload.get("input_ids")
        prompt_tokens = (
            len(input_ids)
            if isinstance(input_ids, list)
            else len(str(payload.get("text", "")).split())
        )
        self._meta: dict[str, Any] = {"id": rid, "prompt_tokens": prompt_tokens, "cached_tokens": 0}
        tenant = headers.get(b"x-isolation-tenant")
        generation = headers.get(b"x-isolation-generation")
        if tenant is not None:
            self._meta["isolation_tenant"] = tenant.decode()
        if generation is not None:
            self._meta["isolation_generation"] = generation.decode()

    def _body(self, tokens: int) -> bytes:
        meta = dict(
            self._meta,
            completion_tokens=tokens,
            finish_reason={"type": "length", "length": tokens}
            if tokens == self._completion
            else None,
        )
        return orjson.dumps(
            {
                "text": TOKEN_TEXT * tokens,
                "output_ids": [OUTPUT_TOKEN_ID] * tokens,
                "meta_info": meta,
            }
        )

    def whole(self) -> bytes:
        return self._body(self._completion)

    def events(self) -> list[bytes]:
        return [b"data: " + self._body(n) + b"\n\n" for n in range(1, self._completion + 1)] + [
            b"data: [DONE]\n\n"
        ]


class OpenAIAnswer:
    """``/v1/completions`` and ``/v1/chat/completions``, in the shape a worker's own API returns."""

    def __init__(self, config: BackendConfig, payload: dict[str, Any], *, chat: bool) -> None:
        max_tokens = int(
            payload.get("max_tokens") or payload.get("max_completion_tokens") or config.chunks
        )
        self._completion = 1 if config.role == "prefill" else max(0, min(config.chunks, max_tokens))
        self._chat = chat
        self._id = "cmpl-" + uuid.uuid4().hex
        self._model = payload.get("model", "instant-backend")
        self._created = int(time.time())

    def whole(self) -> bytes:
        text = TOKEN_TEXT * self._completion
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return orjson.dumps(
            {
                "id": self._id,
                "object": "chat.completion" if self._chat else "text_completion",
                "created": self._created,
                "model": self._model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": 0,
                    "completion_tokens": self._completion,
                    "total_tokens": self._completion,
                },
            }
        )

    def events(self) -> list[bytes]:
        events = []
        for n in range(1, self._completion + 1):
            finish = "length" if n == self._completion else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if self._chat:
                choice["delta"] = {"content": TOKEN_TEXT}
            else:
                choice["text"] = TOKEN_TEXT
            events.append(
                b"data: "
                + orjson.dumps(
                    {
                        "id": self._id,
                        "object": "chat.completion.chunk" if self._chat else "text_completion",
                        "created": self._created,
                        "model": self._model,
                        "choices": [choice],
                    }
                )
                + b"\n\n"
            )
        return [*events, b"data: [DONE]\n\n"]


async def serve(config: BackendConfig, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    statics = _static_bodies(config)
    slow_streams = SlowStreams()
    server = await loop.create_server(
        lambda: BackendProtocol(config, statics, slow_streams),
        host,
        port,
        backlog=4096,
        reuse_address=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pool-tokens", type=int, default=8_388_608)
    parser.add_argument(
        "--chunks", type=int, default=4, help="output tokens per request / stream chunks"
    )
    parser.add_argument("--stream-interval-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    config = BackendConfig(
        role=args.role,
        pool_tokens=args.pool_tokens,
        chunks=args.chunks,
        stream_interval_s=args.stream_interval_s,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
