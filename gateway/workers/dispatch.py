"""Send a tokenized request to a (prefill, decode) pair the way SGLang's own PD router does.

Both workers get the same ``/generate`` body: ``input_ids`` (never text), sampling
parameters, the generation ID as ``rid``, the tenant's cache salt as ``extra_key`` and the
bootstrap triple that pairs them for the KV transfer; both get the isolation headers that
``engine_patch`` carries through the engine. Output is read from decode. Prefill always runs
non-streaming: it produces no text the client sees, only its status matters.

Transport failures become OpenAI errors here (503 worker down, 504 timeout, 502 otherwise).

An exchange given up before both workers answered in full (the client left, a timeout, the
other worker failed) is aborted on both workers by its ``rid`` (SGLang's ``/abort_request``):
closing the connection alone leaves a non-streaming generation running on SGLang to its end,
and its KV pages held meanwhile. This is the one place that happens, for whole answers and
streams alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.common.errors import APIError, unavailable, upstream_failed, upstream_timeout
from gateway.common.ids import bootstrap_room
from gateway.workers.answer_json import parse_answer
from gateway.workers.pairs import WorkerPair
from gateway.workers.refusals import engine_refusal
from gateway.workers.upstream import (
    UpstreamClient,
    UpstreamConnection,
    UpstreamError,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

TENANT_HEADER = "X-Isolation-Tenant"
GENERATION_HEADER = "X-Isolation-Generation"
# Where ``generate`` puts prefill's ``meta_info`` in decode's answer, when prefill scored the
# prompt: a key no engine answer has.
PREFILL_META = "isogate_prefill_meta_info"


@dataclass(slots=True, kw_only=True)
class EngineRequest:
    generation_id: str
    tenant_id: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    cache_salt: str
    # Log probabilities of the completion's tokens, with this many alternatives each; None: none.
    top_logprobs: int | None = None
    # The prompt's tokens scored too (``echo``): prefill computes them, so prefill is asked.
    prompt_logprobs: bool = False
    # SGLang's scheduling priority (larger first), the fair queue's order passed on
    # (gateway.core.fair_queue.engine_priority); None: the workers' default.
    priority: int | None = None


def generate_body(
    pair: WorkerPair, request: EngineRequest, *, stream: bool, prompt_logprobs: bool = False
) -> bytes:
    bootstrap_host, bootstrap_port = pair.bootstrap
    body: dict[str, Any] = {
        "input_ids": request.input_ids,
        "sampling_params": request.sampling_params,
        "stream": stream,
        "rid": request.generation_id,
        "extra_key": request.cache_salt,
        "bootstrap_host": bootstrap_host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": bootstrap_room(request.generation_id),
    }
    if request.priority is not None:
        # Both roles: prefill orders its waiting queue by it, decode its queues and which
        # requests it retracts first when its KV pool runs out.
        body["priority"] = request.priority
    if request.top_logprobs is not None:
        # The completion's; the prompt's only from prefill, and only when asked for (from
        # position 0), since only prefill runs the prompt through the model.
        body["return_logprob"] = True
        body["top_logprobs_num"] = request.top_logprobs
        body["logprob_start_len"] = 0 if prompt_logprobs else -1
    return orjson.dumps(body)


def isolation_headers(request: EngineRequest) -> dict[str, str]:
    return {
        TENANT_HEADER: request.tenant_id,
        GENERATION_HEADER: request.generation_id,
        "Content-Type": "application/json",
    }


_JSON_HEADERS = {"Content-Type": "application/json"}


def _ignore(urls: Iterable[str]) -> None:
    pass


class UpstreamStreamError(Exception):
    """The engine reported an error inside a stream that had already started."""


class PDDispatcher:
    def __init__(
        self, client: UpstreamClient, seen_serving: Callable[[Iterable[str]], None] | None = None
    ) -> None:
        self._client = client
        # Told of every worker that answered a generation in full (its liveness signal).
        self._seen_serving = seen_serving or _ignore
        # Aborts in flight: referenced until done (the loop keeps only weak references).
        self._aborts: set[asyncio.Future[None]] = set()

    async def generate(self, pair: WorkerPair, request: EngineRequest) -> dict[str, Any]:
        """Decode's answer, once prefill and decode have both answered 200.

        Both requests are in flight together, awaited on their connections (no task each); a
        failed prefill leaves decode waiting for a transfer that never comes, so the first
        failure ends the wait and the other exchange is abandoned (its connection closed).
        """
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dispatch", extra={"workers": pair.urls, "stream": False})
        headers = isolation_headers(request)
        body = generate_body(pair, request, stream=False)  # the same for both roles...
        prefill_body = (  # ...unless prefill is to score the prompt
            generate_body(pair, request, stream=False, prompt_logprobs=True)
            if request.prompt_logprobs
            else body
        )
        client = self._client
        exchanges: list[tuple[str, UpstreamConnection]] = []
        try:
            prefill_url, decode_url = pair.generate_urls
            for role, url, role_body in (
                ("prefill", prefill_url, prefill_body),
                ("decode", decode_url, body),
            ):
                # ``_send``'s work inline: one coroutine less per role and request.
                try:
                    connection = await client.send(url, role_body, headers)
                except (UpstreamError, OSError) as exc:
                    raise _transport_error(role, exc) from exc
                exchanges.append((role, connection))
            await client.wait_for_answers([connection for _, connection in exchanges])
            # Prefill first: when both failed, decode's failure is most likely prefill's doing.
            for role, connection in exchanges:
                if connection.answered:  # else abandoned: the other one failed
                    _raise_unless_ok(role, connection)
            answer: dict[str, Any] = parse_answer(exchanges[1][1].body())
            if request.prompt_logprobs:
                prefill_answer = parse_answer(exchanges[0][1].body())
                answer[PREFILL_META] = (
                    prefill_answer.get("meta_info") if isinstance(prefill_answer, dict) else None
                )
            self._seen_serving(pair.urls)
            return answer
        finally:
            # Written out, not all() over a generator: this runs for every request.
            if len(exchanges) < 2 or not (exchanges[0][1].complete and exchanges[1][1].complete):
                self._abort(pair, request)
            for _, connection in exchanges:
                client.finish(connection)

    async def stream(
        self, pair: WorkerPair, request: EngineRequest
    ) -> AsyncGenerator[list[dict[str, Any]]]:
        """Decode's chunks, parsed, in batches of those that arrived together; raises APIError
        before the first batch, UpstreamStreamError after.

        Until decode's first chunk, decode may be silently waiting for a KV transfer that a
        failed prefill will never send (SGLang waits out its transfer timeout, 300 s by
        default), so the first chunk races prefill's answer (awaited on its connection, like
        ``generate``). Once decode has produced a token, the transfer is complete.
        """
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dispatch", extra={"workers": pair.urls, "stream": True})
        client = self._client
        headers = isolation_headers(request)
        prefill = await self._send(
            "prefill", pair.generate_urls[0], generate_body(pair, request, stream=False), headers
        )
        chunks = self._decode_chunks(pair, request, headers)
        first: asyncio.Future[list[dict[str, Any]]] | None = None
        ended = False  # decode's stream ran to its end and prefill answered
        try:
            first = asyncio.ensure_future(chunks.__anext__())
            await asyncio.wait((first, prefill.done), return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                _raise_unless_ok("prefill", prefill)
            try:
                yield await first
            except StopAsyncIteration:
                ended = True
                return
            async for batch in chunks:
                yield batch
            if not prefill.answered:
                await client.wait_for_answers((prefill,))
            ended = True
            _raise_unless_ok("prefill", prefill)
            self._seen_serving(pair.urls)
        finally:
            if not (ended and prefill.complete):
                self._abort(pair, request)
            if first is not None and not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
            client.finish(prefill)
            await chunks.aclose()

    async def _decode_chunks(
        self, pair: WorkerPair, request: EngineRequest, headers: dict[str, str]
    ) -> AsyncGenerator[list[dict[str, Any]]]:
        lines = self._client.stream(
            pair.generate_urls[1], generate_body(pair, request, stream=True), headers
        )
        try:
            status, _ = await lines.__anext__()
            if status != 200:
                raise _engine_error(
                    "decode",
                    status,
                    b"\n".join([line async for _, batch in lines for line in batch]),
                )
            async for _, batch in lines:
                chunks: list[dict[str, Any]] = []
                for line in batch:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        if chunks:
                            yield chunks
                        return
                    chunk = orjson.loads(payload)
                    if "error" in chunk:
                        if chunks:
                            yield chunks  # what came before the error, as it would have unbatched
                        message = _error_message(chunk)
                        log.warning(
                            "engine error mid-stream",
                            extra={"role": "decode", "engine_message": message[:500]},
                        )
                        raise UpstreamStreamError(message)
                    chunks.append(chunk)
                if chunks:
                    yield chunks
        except (UpstreamError, OSError) as exc:
            raise _transport_error("decode", exc) from exc
        finally:
            await lines.aclose()

    async def _send(
        self, role: str, url: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamConnection:
        try:
            return await self._client.send(url, body, headers)
        except (UpstreamError, OSError) as exc:
            raise _transport_error(role, exc) from exc

    def _abort(self, pair: WorkerPair, request: EngineRequest) -> None:
        """Abort the request on both workers, in the background: the caller may be cancelled
        (the client left) and must not wait on a worker to let go."""
        body = orjson.dumps({"rid": request.generation_id})
        abort = asyncio.ensure_future(self._send_aborts(pair.urls, body))
        self._aborts.add(abort)
        abort.add_done_callback(self._aborts.discard)

    async def _send_aborts(self, urls: tuple[str, str], body: bytes) -> None:
        client = self._client
        for url in urls:
            # One at a time: decode waits on prefill's transfer, so prefill goes first.
            try:
                connection = await client.send(f"{url}/abort_request", body, _JSON_HEADERS)
            except (UpstreamError, OSError) as exc:
                log.debug("abort not sent", extra={"worker": url, "error": str(exc)})
                continue
            try:
                await client.wait_for_answers((connection,))
                if connection.failure is not None or connection.status != 200:
                    log.debug("abort refused", extra={"worker": url, "status": connection.status})
            finally:
                client.finish(connection)

    async def aclose(self) -> None:
        for abort in list(self._aborts):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(abort, timeout=2.0)
        await self._client.aclose()


def _raise_unless_ok(role: str, connection: UpstreamConnection) -> None:
    """The error an answered exchange stands for, if it failed or did not answer 200."""
    if connection.failure is not None:
        raise _transport_error(role, connection.failure) from connection.failure
    if connection.status != 200:
        raise _engine_error(role, connection.status, connection.body())


def _transport_error(role: str, exc: BaseException) -> APIError:
    if isinstance(exc, UpstreamTimeout):
        return upstream_timeout(f"The {role} worker did not answer in time.")
    return unavailable(f"The {role} worker is unavailable.", code="worker_unavailable")


def _engine_error(role: str, status: int, body: bytes) -> APIError:
    """The gateway's own error for a worker's refusal or failure. The engine's text is logged
    for operators and not passed on (it names internals), except a grammar compiler's verdict
    on the request's own grammar (``gateway.workers.refusals``)."""
    try:
        message = _error_message(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = body[:200].decode("utf-8", "replace")
    log.warning(
        "engine error", extra={"role": role, "status": status, "engine_message": message[:500]}
    )
    if 400 <= status < 500 and status not in (408, 429):
        return engine_refusal(role, message)
    if status == 503:
        return unavailable(f"The {role} worker is unavailable.", code="worker_unavailable")
    return upstream_failed(f"The {role} worker failed (HTTP {status}).")


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)
