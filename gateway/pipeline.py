"""The request path, top to bottom: auth → tokenize → admit → route → dispatch → verify → audit.

One function per OpenAI generation route runs these steps in order; every step either
passes a value to the next or raises an ``APIError``. Whatever happens, exactly one audit
event is recorded and every claim (rate-limit lease, KV tokens) is released: the non-streaming
path does it in ``finally``, the streaming path hands both to ``GuardedStream``, which does it
when the stream ends, fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import protocol
from .admission import Claim, context_length_exceeded
from .audit import AuditEvent
from .auth import Principal
from .components import Components
from .dispatch import EngineRequest, UpstreamStreamError
from .errors import APIError, bad_request, not_found, unavailable
from .ids import new_generation_id, tenant_cache_salt
from .limits import LimitLease
from .logs import current_generation_id
from .policies import ModelPolicy
from .protocol import RESERVED_HEADER_PREFIXES, ChatCompletionRequest, CompletionRequest
from .routing import WorkerPair
from .tokenize import ChatTurn
from .verify import Expectation, IsolationFailure, StreamGuard, check_meta, check_text

log = logging.getLogger("isogate.request")

Kind = Literal["chat", "completion"]
# On every generation response, errors included: a client can find any request's audit event.
GENERATION_ID_HEADER = "X-Generation-Id"
_GENERATION_ID_HEADER_RAW = GENERATION_ID_HEADER.lower().encode()


@dataclass
class Trace:
    """What the audit event of one request will say; filled in as the request advances."""

    generation_id: str
    created_at: datetime
    started: float
    stream: bool = False
    principal: Principal | None = None
    model: str | None = None
    pair: WorkerPair | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    releases: list[Any] = field(default_factory=list)

    def event(
        self, outcome: str, status: int, code: str | None = None, detail: str | None = None
    ) -> AuditEvent:
        return AuditEvent(
            generation_id=self.generation_id,
            tenant_id=self.principal.tenant_id if self.principal else "",
            key_id=self.principal.key_id if self.principal else None,
            model=self.model,
            outcome=outcome,
            status=status,
            code=code,
            prefill_worker=self.pair.prefill.url if self.pair else None,
            decode_worker=self.pair.decode.url if self.pair else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            stream=self.stream,
            latency_ms=(time.perf_counter() - self.started) * 1000.0,
            created_at=self.created_at,
            detail=detail,
        )


async def handle_generation(components: Components, request: Request, kind: Kind) -> Response:
    trace = Trace(new_generation_id(), datetime.now(UTC), time.perf_counter())
    current_generation_id.set(trace.generation_id)
    try:
        # auth
        headers = ClientHeaders.of(request.scope)
        trace.principal = principal = await components.authenticator.authenticate(
            headers.authorization
        )
        if principal.is_admin:
            raise APIError(
                403,
                "The admin key cannot run generations; use a tenant key.",
                "permission_error",
                "admin_key_not_allowed",
            )
        if headers.reserved is not None:
            raise bad_request(
                f"Header '{headers.reserved}' is set by the gateway and may not be supplied by a client.",
                code="reserved_header",
            )
        body = await read_body(
            request.receive, headers.content_length, components.settings.max_body_bytes
        )
        parsed = protocol.parse_request(
            body, ChatCompletionRequest if kind == "chat" else CompletionRequest
        )
        trace.stream = parsed.stream
        trace.model = parsed.model
        policies = components.policies
        model = policies.models.get(parsed.model)
        if model is None:
            raise not_found(
                f"The model '{parsed.model}' does not exist.", code="model_not_found", param="model"
            )
        max_tokens = _max_tokens(parsed, model)

        # tokenize (refusing, before tokenizing, what its byte length alone proves too long)
        candidates = components.routes.candidates(policies, model, principal.tenant_id)
        margin = components.settings.admission_safety_margin_tokens
        limit = candidates.best_limit(max_tokens, margin)
        input_ids = await _tokenize(components, model, parsed, limit, max_tokens)
        trace.prompt_tokens = prompt_tokens = len(input_ids)

        # admit
        if prompt_tokens > limit.tokens:
            raise _refuse(components, model, prompt_tokens, limit, max_tokens)
        lease = await components.limiter.acquire(
            principal.tenant_id,
            policies.tenant(principal.tenant_id).limits,
            prompt_tokens + max_tokens,
        )
        trace.releases.append(lease)

        # route
        pair = candidates.choose(components.ledger, prompt_tokens, max_tokens, margin)
        if pair is None:
            raise unavailable(
                "Every worker pair that could hold this request is busy; try again shortly.",
                code="capacity_busy",
            )
        trace.pair = pair
        trace.releases.append(
            components.ledger.claim(pair.urls, prompt_tokens + max_tokens + margin)
        )

        engine_request = EngineRequest(
            generation_id=trace.generation_id,
            tenant_id=principal.tenant_id,
            input_ids=input_ids,
            sampling_params=_sampling_params(parsed, max_tokens),
            cache_salt=tenant_cache_salt(
                components.settings.cache_salt_secret, principal.tenant_id
            ),
        )
        expected = Expectation(
            trace.generation_id,
            principal.tenant_id,
            prompt_tokens,
            max_tokens,
            model.require_engine_tags,
        )

        # dispatch → verify → audit
        if parsed.stream:
            return await _stream(
                components, trace, pair, engine_request, expected, kind, parsed.include_usage
            )
        output = await components.dispatcher.generate(pair, engine_request)
        meta = output.get("meta_info")
        check_meta(meta, expected)
        text = output.get("text", "")
        check_text(components.scanner, text, principal.tenant_id)
        finish_reason = _finish_reason(meta)
        trace.completion_tokens = meta.get("completion_tokens", 0)
        usage = protocol.usage(prompt_tokens, trace.completion_tokens, meta.get("cached_tokens", 0))
        build = protocol.chat_completion if kind == "chat" else protocol.completion
        result = build(trace.generation_id, model.name, protocol.now(), text, finish_reason, usage)
        await _settle(trace)
        _finish(components, trace, "served", 200)
        return JSONBodyResponse(orjson.dumps(result), trace.generation_id)
    except IsolationFailure as failure:
        await _settle(trace)
        _record_failure(components, trace, failure)
        return _with_generation_id(failure.api_error().response(), trace)
    except APIError as error:
        await _settle(trace)
        _finish(components, trace, _outcome(error), error.status, error.code, error.message[:300])
        return _with_generation_id(error.response(), trace)
    except ClientDisconnect:
        _finish(components, trace, "client_cancelled", 499, "client_cancelled")
        return _with_generation_id(
            APIError(
                499, "The client went away.", "invalid_request_error", "client_cancelled"
            ).response(),
            trace,
        )
    except asyncio.CancelledError:
        # The client went away while we waited on a worker: still exactly one event.
        _finish(components, trace, "client_cancelled", 499, "client_cancelled")
        raise
    except Exception as exc:
        log.exception("unexpected error serving a generation")
        _finish(components, trace, "upstream_error", 500, "internal_error", f"{type(exc).__name__}")
        return _with_generation_id(
            APIError(500, "Internal error.", "server_error", "internal_error").response(), trace
        )
    finally:
        await _release(trace)


def _with_generation_id(response: Response, trace: Trace) -> Response:
    response.headers[GENERATION_ID_HEADER] = trace.generation_id
    return response


@dataclass(frozen=True, slots=True)
class ClientHeaders:
    """The request headers the pipeline reads, found in one pass over the raw ASGI list.

    (Starlette's ``Headers`` searches the whole list again for each name it is asked for.)
    """

    authorization: str | None
    content_length: str | None
    reserved: str | None  # the first header only the gateway may set, if the client sent one

    @classmethod
    def of(cls, scope: Scope) -> ClientHeaders:
        authorization = content_length = reserved = None
        for name, value in scope["headers"]:  # lower-case names (ASGI); the first of a name counts
            if name == b"authorization":
                if authorization is None:
                    authorization = value.decode("latin-1")
            elif name == b"content-length":
                if content_length is None:
                    content_length = value.decode("latin-1")
            elif reserved is None and name.startswith(_RESERVED_PREFIXES):
                reserved = name.decode("latin-1")
        return cls(authorization, content_length, reserved)


_RESERVED_PREFIXES = tuple(prefix.encode() for prefix in RESERVED_HEADER_PREFIXES)


async def read_body(receive: Receive, declared_length: str | None, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > limit:
        raise APIError(
            413,
            f"Request body exceeds {limit} bytes.",
            "invalid_request_error",
            "request_too_large",
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(
                413,
                f"Request body exceeds {limit} bytes.",
                "invalid_request_error",
                "request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class JSONBodyResponse(Response):
    """A served response: JSON bytes with their length and the generation ID.

    The headers are set directly rather than by ``Response.__init__``, which rebuilds them
    from a dict for every response.
    """

    def __init__(self, body: bytes, generation_id: str) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (_GENERATION_ID_HEADER_RAW, generation_id.encode()),
        ]


def _max_tokens(parsed: ChatCompletionRequest | CompletionRequest, model: ModelPolicy) -> int:
    requested = parsed.requested_max_tokens
    if requested is None:
        return model.default_max_tokens
    if requested > model.max_output_tokens:
        raise bad_request(
            f"max_tokens is {requested}; this model allows at most {model.max_output_tokens}.",
            code="invalid_value",
            param="max_tokens",
        )
    return requested


async def _tokenize(
    components: Components,
    model: ModelPolicy,
    parsed: ChatCompletionRequest | CompletionRequest,
    limit,
    max_tokens: int,
) -> list[int]:
    tokenizer = components.tokenizers[model.name]
    if (
        isinstance(parsed, CompletionRequest)
        and isinstance(parsed.prompt, list)
        and parsed.prompt
        and isinstance(parsed.prompt[0], int)
    ):
        if len(parsed.prompt) > limit.tokens:
            raise _refuse(components, model, len(parsed.prompt), limit, max_tokens)
        return tokenizer.check_token_ids(parsed.prompt)
    if isinstance(parsed, ChatCompletionRequest):
        turns = [ChatTurn(m.role, m.text()) for m in parsed.messages]
        text_bytes = sum(protocol.utf8_length(t.content) for t in turns)
    else:
        text = parsed.prompt if isinstance(parsed.prompt, str) else parsed.prompt[0]
        text_bytes = protocol.utf8_length(text)
    at_least = tokenizer.min_tokens_for_bytes(text_bytes)
    if at_least > limit.tokens:
        components.metrics.refused_untokenized_inc(model.name)
        raise _refuse(components, model, f"at least {at_least}", limit, max_tokens)
    if isinstance(parsed, ChatCompletionRequest):
        return await tokenizer.encode_chat(turns)
    return await tokenizer.encode_text(text)


def _sampling_params(
    parsed: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": parsed.temperature,
        "top_p": parsed.top_p,
        "presence_penalty": parsed.presence_penalty,
        "frequency_penalty": parsed.frequency_penalty,
    }
    if parsed.stop is not None:
        params["stop"] = parsed.stop
    if parsed.seed is not None:
        params["sampling_seed"] = parsed.seed
    return params


def _finish_reason(meta: dict[str, Any]) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        # An engine abort reported with 200 is a failure, never content (see ARCHITECTURE: the
        # 0.5.23 abort with status_code=None answers 200).
        message = reason.get("message") if isinstance(reason, dict) else None
        raise IsolationFailure(f"engine aborted the request: {message or 'no reason given'}")
    return "length" if kind == "length" else "stop"


def _outcome(error: APIError) -> str:
    if error.status == 429:
        return "rate_limited"
    if error.status in (502, 503, 504):
        return "upstream_error"
    return "rejected"


def _record_failure(components: Components, trace: Trace, failure: IsolationFailure) -> None:
    log.error(
        "isolation check failed",
        extra={
            "generation_id": trace.generation_id,
            "reason": failure.reason,
            "tenant_id": trace.principal.tenant_id if trace.principal else None,
        },
    )
    components.metrics.verification_failed(trace.model or "", failure.reason)
    _finish(components, trace, "verification_failed", 502, "isolation_check_failed", failure.reason)


def _refuse(
    components: Components, model: ModelPolicy, prompt_tokens: int | str, limit, max_tokens: int
) -> APIError:
    """Gate 1's refusal, counted by the bound that set the limit."""
    components.metrics.admission_refusals.labels(model.name, limit.bound).inc()
    return context_length_exceeded(prompt_tokens, limit, max_tokens)


def _finish(
    components: Components,
    trace: Trace,
    outcome: str,
    status: int,
    code: str | None = None,
    detail: str | None = None,
) -> None:
    """The one place a request's outcome is recorded: its audit event, counters, latency, log line."""
    event = trace.event(outcome, status, code, detail)
    components.audit.record(event)
    # A served request's line is DEBUG: the audit event already records it, and at INFO the
    # line cost as much CPU as the audit insert (bench/RESULTS.md). Every other outcome is INFO.
    level = logging.DEBUG if outcome == "served" else logging.INFO
    if log.isEnabledFor(level):
        log.log(
            level,
            "request finished",
            extra={
                "outcome": outcome,
                "status": status,
                "code": code,
                "latency_ms": round(event.latency_ms, 3),
            },
        )
    tenant = trace.principal.tenant_id if trace.principal else ""
    # A model name the client made up is not a label value: that would let clients grow the series.
    model = trace.model if trace.model in components.policies.models else ""
    components.metrics.observe_request(model, tenant, outcome, time.perf_counter() - trace.started)


async def _settle(trace: Trace) -> None:
    for item in trace.releases:
        if (
            isinstance(item, LimitLease)
            and trace.completion_tokens is not None
            and trace.prompt_tokens is not None
        ):
            await item.settle(trace.prompt_tokens + trace.completion_tokens)


async def _release(trace: Trace) -> None:
    releases, trace.releases = trace.releases, []
    for item in releases:
        if isinstance(item, Claim):
            item.release()
        else:
            await item.release()


# ---- streaming ---------------------------------------------------------------------------


async def _stream(
    components: Components,
    trace: Trace,
    pair: WorkerPair,
    engine_request: EngineRequest,
    expected: Expectation,
    kind: Kind,
    include_usage: bool,
) -> Response:
    """Pull and check the first engine chunks before answering, so early failures keep their status."""
    batches = components.dispatcher.stream(pair, engine_request).__aiter__()
    guard = StreamGuard(components.scanner, expected.tenant_id)
    try:
        first_delta, first_meta = _checked_delta(await batches.__anext__(), expected, guard)
    except StopAsyncIteration:
        raise APIError(
            502,
            "The decode worker ended the stream without output.",
            "upstream_error",
            "upstream_error",
        )
    except BaseException:
        await batches.aclose()
        raise
    stream = GuardedStream(
        components,
        trace,
        _sse_events(trace, batches, first_delta, first_meta, guard, expected, kind, include_usage),
    )
    trace.releases = []  # the stream owns them now
    return stream


def _checked_delta(
    batch: list[dict[str, Any]], expected: Expectation, guard: StreamGuard
) -> tuple[str, dict[str, Any]]:
    """The text that engine chunks which arrived together add for the client, once every one of
    them has passed the checks (none of a batch is sent before all of it is checked); and the
    last chunk's ``meta_info``."""
    for chunk in batch:
        check_meta(chunk.get("meta_info"), expected)
    return guard.feed_all([chunk.get("text", "") for chunk in batch]), batch[-1]["meta_info"]


async def _sse_events(
    trace: Trace,
    batches: AsyncIterator[list[dict[str, Any]]],
    first_delta: str,
    first_meta: dict[str, Any],
    guard: StreamGuard,
    expected: Expectation,
    kind: Kind,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The client's SSE events, written together when they are ready together: what is checked
    goes out before the next wait on decode, the end of the stream with its last text."""
    model, gid, created = trace.model or "", trace.generation_id, protocol.now()

    def content(delta: str) -> bytes:
        if kind == "chat":
            return _sse(protocol.chat_chunk(gid, model, created, {"content": delta}, None))
        return _sse(protocol.completion_chunk(gid, model, created, delta, None))

    events: list[bytes] = []
    if kind == "chat":
        events.append(
            _sse(
                protocol.chat_chunk(gid, model, created, {"role": "assistant", "content": ""}, None)
            )
        )
    if first_delta:
        events.append(content(first_delta))
    meta = first_meta
    while True:
        # After the chunk that carries the finish reason only the end of the stream follows,
        # so its text waits for it and both go out in one write.
        if events and meta.get("finish_reason") is None:
            yield b"".join(events)
            events = []
        try:
            batch = await batches.__anext__()
        except StopAsyncIteration:
            break
        delta, meta = _checked_delta(batch, expected, guard)
        if delta:
            events.append(content(delta))
    finish_reason = _finish_reason(meta)
    tail = guard.finish()
    if tail:
        events.append(content(tail))
    if kind == "chat":
        events.append(_sse(protocol.chat_chunk(gid, model, created, {}, finish_reason)))
    else:
        events.append(_sse(protocol.completion_chunk(gid, model, created, "", finish_reason)))
    trace.completion_tokens = meta.get("completion_tokens", 0)
    if include_usage:
        usage = protocol.usage(
            expected.prompt_tokens, trace.completion_tokens, meta.get("cached_tokens", 0)
        )
        object_ = "chat.completion.chunk" if kind == "chat" else "text_completion"
        events.append(_sse(protocol.usage_chunk(gid, model, created, object_, usage)))
    events.append(b"data: [DONE]\n\n")
    yield b"".join(events)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class GuardedStream(Response):
    """An SSE response that always audits and releases, however the stream ends.

    A failure after the first byte cannot change the status any more: the stream ends with one
    OpenAI-format error event and nothing else (no ``[DONE]``), so a client never mistakes a
    withheld response for a complete one.
    """

    def __init__(self, components: Components, trace: Trace, events: AsyncIterator[bytes]) -> None:
        # Not Response.__init__: it would declare Content-Length: 0 for the empty initial body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (_GENERATION_ID_HEADER_RAW, trace.generation_id.encode()),
        ]
        self._components = components
        self._trace = trace
        self._events = events
        self._releases = list(trace.releases)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace = self._trace
        trace.releases = self._releases
        outcome: list[tuple[str, int, str | None, str | None]] = [
            ("client_cancelled", 499, "client_cancelled", None)
        ]
        # uvicorn's send() returns silently once the client has gone: without listening for
        # http.disconnect the engine stream would be pulled to its end, claims held meanwhile.
        pump = asyncio.ensure_future(self._pump(send, outcome))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watcher):
                task.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)
            await self._events.aclose()
            await _settle(trace)
            await _release(trace)
            _finish(self._components, trace, *outcome[0])
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]

    async def _pump(
        self, send: Send, outcome: list[tuple[str, int, str | None, str | None]]
    ) -> None:
        trace, components = self._trace, self._components
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            outcome[0] = ("served", 200, None, None)
        except IsolationFailure as failure:
            await send(
                {
                    "type": "http.response.body",
                    "body": _sse(failure.api_error().body()),
                    "more_body": True,
                }
            )
            log.error(
                "isolation check failed mid-stream",
                extra={"generation_id": trace.generation_id, "reason": failure.reason},
            )
            components.metrics.verification_failed(trace.model or "", failure.reason)
            outcome[0] = ("verification_failed", 200, "isolation_check_failed", failure.reason)
        except (APIError, UpstreamStreamError) as error:
            api_error = (
                error
                if isinstance(error, APIError)
                else APIError(
                    502,
                    f"The decode worker failed mid-stream: {error}",
                    "upstream_error",
                    "upstream_error",
                )
            )
            await send(
                {"type": "http.response.body", "body": _sse(api_error.body()), "more_body": True}
            )
            outcome[0] = ("upstream_error", 200, api_error.code, api_error.message[:300])
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
