"""An instant SGLang-protocol backend (NOT SGLang): one role (prefill or decode) on a raw asyncio
protocol that answers at once what routers ask of a worker, in SGLang 0.5.23's shapes
(``tests/data``; ``/server_info`` marked ``"isogate_engine_patch": "instant-backend"``). Streams
send ``--chunks`` chunks ``--stream-interval-s`` apart (0: one write); ``GET /bench/streams``
says how many slow streams are still sending (the memory bench).

    python -m bench.instant_backend --role decode --port 34010 [--pool-tokens N] [--chunks 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httptools
import orjson
import uvloop

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
TOKEN_TEXT = " tok"  # one "token" of output text
OUTPUT_TOKEN_ID = 56
GENERATE_PATHS = (b"/generate", b"/v1/completions", b"/v1/chat/completions")


def static_bodies(role: str, pool_tokens: int) -> dict[bytes, bytes]:
    """The GET answers, serialised once: they never change."""
    info = json.loads((DATA / f"server_info_{role}.json").read_text())
    loads = json.loads((DATA / f"loads_{role}.json").read_text())
    internal = dict((info.get("internal_states") or [{}])[0])
    p = pool_tokens
    internal.update(max_total_num_tokens=p, context_length=p, max_req_input_len=p - 1)
    info.update(internal_states=[internal], context_length=p, disaggregation_mode=role)
    info["isogate_engine_patch"] = "instant-backend"
    info["incremental_streaming_output"] = True  # as docs/operations.md starts decode workers
    loads["loads"] = [dict(loads["loads"][0], max_total_num_tokens=pool_tokens, num_used_tokens=0)]
    model = {"id": "instant-backend", "object": "model", "owned_by": "bench"}
    models = {"object": "list", "data": [dict(model, max_model_len=pool_tokens)]}
    model_info = {"model_path": "instant-backend", "is_generation": True}
    bodies = {b"/server_info": info, b"/get_server_info": info, b"/v1/loads": loads}
    bodies |= {b"/v1/models": models, b"/get_model_info": model_info}
    empty = dict.fromkeys((b"/health", b"/health_generate", b"/readiness", b"/liveness"), b"")
    return {path: orjson.dumps(body) for path, body in bodies.items()} | empty


def head(status: int, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"Error")
    size = b"content-length: %d" % length if length is not None else b"transfer-encoding: chunked"
    lines = [b"HTTP/1.1 %d %s" % (status, reason), b"content-type: " + content_type, size]
    lines += [] if keep_alive else [b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(
    args: argparse.Namespace, path: bytes, payload: dict[str, Any], headers: dict[bytes, bytes]
) -> list[bytes]:
    """The whole answer's body, or a stream's events: SGLang's native shape for ``/generate``
    (with the tags engine_patch would echo), else the OpenAI shape."""
    stream = bool(payload.get("stream"))
    if path == b"/generate":
        asked = (payload.get("sampling_params") or {}).get("max_new_tokens")
    else:
        asked = payload.get("max_tokens") or payload.get("max_completion_tokens")
    tokens = 1 if args.role == "prefill" else max(0, min(args.chunks, int(asked or args.chunks)))
    counts = range(1, tokens + 1) if stream else [tokens]
    if path == b"/generate":
        ids = payload.get("input_ids")
        prompt = len(ids) if isinstance(ids, list) else len(str(payload.get("text", "")).split())
        rid = payload.get("rid") or uuid.uuid4().hex
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": prompt, "cached_tokens": 0}
        for name in ("tenant", "generation"):
            if (value := headers.get(b"x-isolation-" + name.encode())) is not None:
                meta["isolation_" + name] = value.decode()
        # A stream's chunks carry what each adds (``--incremental-streaming-output``).
        added = 1 if stream else tokens
        bodies = [
            {
                "text": TOKEN_TEXT * added,
                "output_ids": [OUTPUT_TOKEN_ID] * added,
                "meta_info": dict(
                    meta,
                    completion_tokens=n,
                    finish_reason={"type": "length", "length": n} if n == tokens else None,
                ),
            }
            for n in counts
        ]
    else:
        chat = path == b"/v1/chat/completions"
        kind = "chat.completion" if chat else "text_completion"
        envelope = {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": kind + ".chunk" if chat and stream else kind,
            "created": int(time.time()),
            "model": payload.get("model", "instant-backend"),
        }
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        bodies = []
        for n in counts:
            text = TOKEN_TEXT if stream else TOKEN_TEXT * tokens
            finish = "length" if n == tokens else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if not chat:
                choice["text"] = text
            elif stream:
                choice["delta"] = {"content": text}
            else:
                choice["message"] = {"role": "assistant", "content": text}
            bodies.append(dict(envelope, choices=[choice]) | ({} if stream else {"usage": usage}))
    if not stream:
        return [orjson.dumps(bodies[0])]
    return [b"data: " + orjson.dumps(body) + b"\n\n" for body in bodies] + [b"data: [DONE]\n\n"]


class BackendProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer each once it is complete."""

    def __init__(
        self, args: argparse.Namespace, statics: dict[bytes, bytes], slow: set[BackendProtocol]
    ) -> None:
        self._args, self._statics, self._slow = args, statics, slow
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._pending: asyncio.TimerHandle | None = None  # the next chunk of a slow stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close()
        except httptools.HttpParserError:
            self._write(head(400, b"text/plain", 0, False))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self._slow.discard(self)
        self._transport = None

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self._parser.should_keep_alive()
        path = self._url.split(b"?", 1)[0]
        method = self._parser.get_method()
        if method == b"GET" and path == b"/bench/streams":
            body: bytes | None = orjson.dumps({"in_progress": len(self._slow)})
        else:
            body = self._statics.get(path) if method == b"GET" else None
        if body is not None:
            self._write(head(200, b"application/json", len(body), keep_alive) + body)
        elif method == b"POST" and path in GENERATE_PATHS:
            if self._generate(path, keep_alive):
                return  # a slow stream closes (if it must) when it ends
        else:
            self._write(head(404, b"application/json", 2, keep_alive) + b"{}")
        if not keep_alive:
            self._close()

    def _generate(self, path: bytes, keep_alive: bool) -> bool:
        """Answer; True when the answer is a slow stream still in progress."""
        payload = orjson.loads(b"".join(self._body)) if self._body else {}
        events = answer(self._args, path, payload, self._headers)
        if not payload.get("stream"):
            self._write(head(200, b"application/json", len(events[0]), keep_alive) + events[0])
            return False
        stream_head = head(200, b"text/event-stream", None, keep_alive)
        if self._args.stream_interval_s <= 0:  # one write: head, every chunk, the end
            self._write(stream_head + b"".join(chunk(e) for e in events) + b"0\r\n\r\n")
            return False
        self._write(stream_head)
        remaining = iter(events)
        loop = asyncio.get_running_loop()

        def send_next() -> None:
            if self._transport is None:
                return
            self._pending = None
            event = next(remaining, None)
            if event is None:
                self._slow.discard(self)
                self._write(b"0\r\n\r\n")
                if not keep_alive:
                    self._close()
                return
            self._write(chunk(event))
            self._pending = loop.call_later(self._args.stream_interval_s, send_next)

        self._slow.add(self)
        send_next()
        return True

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    statics = static_bodies(args.role, args.pool_tokens)
    slow: set[BackendProtocol] = set()
    protocol = lambda: BackendProtocol(args, statics, slow)  # noqa: E731
    server = await loop.create_server(protocol, "127.0.0.1", args.port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pool-tokens", type=int, default=8_388_608)
    parser.add_argument("--chunks", type=int, default=4, help="output tokens (stream chunks)")
    parser.add_argument("--stream-interval-s", type=float, default=0.0)
    uvloop.install()
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
