"""A stand-in SGLang worker, for what real SGLang cannot do on purpose: lie, hang, or drop.

It answers the capacity endpoints with the shapes recorded from real SGLang 0.5.23
(``tests/data``) and ``/generate`` according to a ``Behaviour``. It is never used where a real
worker would do: honest-path tests run against real SGLang.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.dev.harness import free_port

DATA = Path(__file__).parent / "data"


def rid_offset(rid: str) -> float:
    """How much less likely than the others the stand-in makes a request's tokens."""
    return (zlib.crc32(rid.encode()) % 100) / 100


@dataclass
class Behaviour:
    """How the stand-in answers ``/generate``. Defaults: an honest, tag-echoing decode."""

    text_chunks: tuple[str, ...] = ("Hello", " world")
    echo_tags: bool = True
    wrong_generation: bool = False
    wrong_tenant: bool = False
    wrong_meta_id: bool = False
    prompt_tokens_delta: int = 0
    extra_completion_tokens: int = 0
    hang: bool = False
    drop_connection: bool = False
    status: int = 200
    lie_from_chunk: int = 0  # for streams: lie only from this chunk on (0 = from the first)
    pool_tokens: int = 8192
    engine_patch: str | None = "standin"
    # Log probabilities, when asked for: entries more (or fewer) than completion tokens, and
    # a token id to report instead of the real ones (e.g. one outside the vocabulary).
    logprob_entries_delta: int = 0
    logprob_token: int | None = None
    # Answer each request as if it were the one before it (its rid and tags): a choice's
    # answer swapped with, or duplicating, another's.
    swap_with_previous: bool = False
    # Capacity endpoints (/server_info, /v1/loads, /v1/models) answer this much later: a worker
    # busy serving, whose polls are slow.
    capacity_delay_s: float = 0.0
    # What /health answers (SGLang's liveness probe).
    health_status: int = 200
    # A closed gate holds every /generate until the test opens it: a pair kept saturated for
    # exactly as long as a test needs, not for a guessed time.
    gate: threading.Event | None = None
    # Prefill's scores of the prompt (``logprob_start_len`` 0): for token ids this much off
    # the prompt's, as if another sequence had been scored.
    prompt_scores_shift: int = 0
    # A stream sends its first chunk, then holds the rest until the test sets this: chunks
    # that must reach the gateway apart do, however busy the machine.
    rest_of_stream: threading.Event | None = None
    # The last chunk's (or the answer's) finish_reason; None: length, at the last chunk.
    finish: dict[str, Any] | None = None
    # Report the whole pool in use at every capacity poll while a generation is answered and
    # at this many polls after the last one ended (None: a small use that moves every poll):
    # the report of a poll taken while earlier requests ran, made to lag their end on purpose.
    full_pool_polls_after: int | None = None


class _DroppedConnection(Response):
    """Starts a response, then dies: the client sees the connection close mid-answer."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope, receive, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"1000")],
            }
        )
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        raise ConnectionResetError("stand-in drops the connection")


@dataclass
class StandInWorker:
    role: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    port: int = field(default_factory=free_port)
    requests: list[dict[str, Any]] = field(default_factory=list)
    # The rids of the aborts it was sent (SGLang's ``/abort_request``).
    aborted: list[str] = field(default_factory=list)
    polls: int = 0
    health_probes: int = 0
    _full_polls_left: int = 0
    # Generations being answered now, and the most there ever were at once (a stream counts
    # until its response is handed over, not while its body is sent).
    in_flight: int = 0
    most_in_flight: int = 0
    # How long an idle connection stays open (uvicorn's keep-alive): a test looking for
    # connections the gateway never gave back keeps them open long enough to be counted.
    keep_alive_s: int = 5
    _previous: dict[str, Any] | None = None
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        info = json.loads((DATA / f"server_info_{self.role}.json").read_text())
        loads = json.loads((DATA / f"loads_{self.role}.json").read_text())

        async def server_info(request: Request) -> Response:
            await asyncio.sleep(self.behaviour.capacity_delay_s)
            body = dict(info)
            body["internal_states"] = [
                dict(info["internal_states"][0], max_total_num_tokens=self.behaviour.pool_tokens)
            ]
            if self.behaviour.engine_patch:
                body["isogate_engine_patch"] = self.behaviour.engine_patch
            return JSONResponse(body)

        async def v1_loads(request: Request) -> Response:
            await asyncio.sleep(self.behaviour.capacity_delay_s)
            # Every poll sees a different use, so two observations are equal only if they are one.
            self.polls += 1
            b = self.behaviour
            used = self.polls % 97
            if b.full_pool_polls_after is not None:
                if self.in_flight:
                    self._full_polls_left = b.full_pool_polls_after
                if self.in_flight or self._full_polls_left:
                    self._full_polls_left -= not self.in_flight
                    used = b.pool_tokens
            body = dict(loads)
            body["loads"] = [
                dict(
                    loads["loads"][0],
                    max_total_num_tokens=b.pool_tokens,
                    num_used_tokens=used,
                )
            ]
            return JSONResponse(body)

        async def v1_models(request: Request) -> Response:
            await asyncio.sleep(self.behaviour.capacity_delay_s)
            return JSONResponse(
                {"object": "list", "data": [{"id": "standin", "max_model_len": 65536}]}
            )

        async def generate(request: Request) -> Response:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                return await answer(request)
            finally:
                self.in_flight -= 1

        async def answer(request: Request) -> Response:
            body = orjson.loads(await request.body())
            body["_headers"] = dict(request.headers)
            self.requests.append(body)
            b = self.behaviour
            if b.swap_with_previous and self.role == "decode":
                previous, self._previous = self._previous, body
                if previous is not None:
                    body = dict(
                        body, rid=previous["rid"], _headers=previous["_headers"], _swapped=True
                    )
            if b.hang:
                await asyncio.sleep(3600)
            # A threading.Event, set from the test's thread: no asyncio.Event can be.
            while b.gate is not None and not b.gate.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            if b.drop_connection:
                return _DroppedConnection()
            if b.status != 200:
                return JSONResponse(
                    {"error": {"message": "stand-in failure"}}, status_code=b.status
                )
            if self.role == "prefill":
                return JSONResponse({"text": "", "meta_info": self._meta(body, 0, 1, lie=False)})
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            text = "".join(b.text_chunks)
            return JSONResponse(
                {
                    "text": text,
                    "meta_info": self._meta(body, len(b.text_chunks), len(b.text_chunks), lie=True),
                }
            )

        async def health(request: Request) -> Response:
            self.health_probes += 1
            return Response(status_code=self.behaviour.health_status)

        async def abort_request(request: Request) -> Response:
            self.aborted.append(orjson.loads(await request.body()).get("rid", ""))
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/abort_request", abort_request, methods=["POST"]),
                Route("/health", health),
                Route("/server_info", server_info),
                Route("/v1/loads", v1_loads),
                Route("/v1/models", v1_models),
                Route("/generate", generate, methods=["POST"]),
            ]
        )

    async def _stream(self, body: dict[str, Any]):
        text = ""
        chunks = self.behaviour.text_chunks
        rest = self.behaviour.rest_of_stream
        for index, chunk in enumerate(chunks):
            text += chunk
            lie = index >= self.behaviour.lie_from_chunk
            meta = self._meta(body, index + 1, len(chunks), lie=lie)
            yield b"data: " + orjson.dumps({"text": text, "meta_info": meta}) + b"\n\n"
            await asyncio.sleep(0.01)
            while index == 0 and rest is not None and not rest.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.005)  # a threading.Event, set from the test's thread
        yield b"data: [DONE]\n\n"

    def _meta(
        self, body: dict[str, Any], completion_tokens: int, total: int, *, lie: bool
    ) -> dict[str, Any]:
        b = self.behaviour
        lie = lie or bool(body.get("_swapped"))
        headers = body["_headers"]
        generation = headers.get("x-isolation-generation", "")
        tenant = headers.get("x-isolation-tenant", "")
        meta: dict[str, Any] = {
            "id": "gen_OTHER" if (lie and b.wrong_meta_id) else body.get("rid"),
            "prompt_tokens": len(body.get("input_ids", [])) + (b.prompt_tokens_delta if lie else 0),
            "completion_tokens": completion_tokens + (b.extra_completion_tokens if lie else 0),
            "cached_tokens": 0,
            "finish_reason": (b.finish or {"type": "length", "length": total})
            if completion_tokens == total
            else None,
        }
        if b.echo_tags:
            meta["isolation_generation"] = (
                "gen_01OTHERGENERATION0000000" if (lie and b.wrong_generation) else generation
            )
            meta["isolation_tenant"] = "some-other-tenant" if (lie and b.wrong_tenant) else tenant
        if body.get("return_logprob"):
            count = meta["completion_tokens"] + (b.logprob_entries_delta if lie else 0)
            token = b.logprob_token if (lie and b.logprob_token is not None) else None
            # Each request's own likelihood, so that choices can be ranked (best_of).
            offset = rid_offset(str(body.get("rid")))
            meta["output_token_logprobs"] = [
                [-0.25 * (i + 1) - offset, token if token is not None else 40 + i, None]
                for i in range(max(0, count))
            ]
            meta["input_token_logprobs"] = []
            top = body.get("top_logprobs_num") or 0
            if top:
                meta["output_top_logprobs"] = [
                    [[-0.25 * (i + 1) - j, 40 + i + j, None] for j in range(top)]
                    for i in range(max(0, count))
                ]
            if body.get("logprob_start_len") == 0:  # the prompt scored, as SGLang's prefill does
                scored = [t + b.prompt_scores_shift for t in body.get("input_ids", [])]
                meta["input_token_logprobs"] = [
                    [None if i == 0 else -0.5 * i, t, None] for i, t in enumerate(scored)
                ]
                meta["input_top_logprobs"] = [None] + [
                    [[-0.5 * i - j, 40 + j, None] for j in range(top)]
                    for i in range(1, len(scored))
                ]
        return meta

    def start(self) -> StandInWorker:
        config = uvicorn.Config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=self.keep_alive_s,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in worker did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> StandInWorker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
