"""The floor of section 1 (NOT the gateway): a bare PD relay on the gateway's own HTTP stack
(uvicorn + httptools on uvloop, the gateway's ``UpstreamClient``), in front of the instant pair.

Why: the question each section-1 run leaves is whether the gateway's cost per request is its
HTTP layer or its own checks. This relay does what a PD router must and nothing more, as
``sglang_router`` does it: it parses a completion request, sends it to prefill and decode with a
bootstrap room, and returns decode's answer as it came. No authentication, tokenization,
admission, limits, verification, audit or metrics. Whole responses only (section 1's plain
cells); the bench never sends it a stream.

    python -m bench.python_relay --port 34015 --prefill URL --decode URL --bootstrap-port N
"""

from __future__ import annotations

import argparse
import secrets
from typing import Any

import orjson
import uvicorn

from gateway.workers.upstream import UpstreamClient

_JSON = [(b"content-type", b"application/json")]
_ROOM_BITS = 63


def relay_app(prefill: str, decode: str, bootstrap_port: int) -> Any:
    """The ASGI app: ``POST /v1/completions`` relayed to the pair; ``GET /health`` answers 200."""
    client = UpstreamClient(connect_timeout_s=2.0, timeout_s=60.0)
    targets = (prefill + "/v1/completions", decode + "/v1/completions")
    headers = {"Content-Type": "application/json"}
    pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan: nothing to start
        if scope["method"] == "GET":
            await _answer(send, 200, b"")
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = orjson.loads(body)
        request |= pairing | {"bootstrap_room": secrets.randbits(_ROOM_BITS)}
        upstream = orjson.dumps(request)
        connections = [await client.send(url, upstream, headers) for url in targets]
        try:
            await client.wait_for_answers(connections)
            status, answer = connections[1].status, connections[1].body()
        finally:
            for connection in connections:
                client.finish(connection)
        await _answer(send, status, answer)

    return app


async def _answer(send: Any, status: int, body: bytes) -> None:
    head = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True)
    args = parser.parse_args()
    app = relay_app(args.prefill, args.decode, args.bootstrap_port)
    # The options the gateway serves with (gateway.cli.main), less its bounded protocol.
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
        lifespan="off", access_log=False, server_header=False, log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()
