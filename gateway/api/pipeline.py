"""The HTTP side of a generation: read the request, hand it to the core, write the response.

The request path reads top to bottom in ``handle_generation``: auth → parse → (the core:
``gateway.core.generation``) admit → claim → dispatch → verify → (``answers``) the JSON body or
the SSE events → audit.
Every step either passes a value to the next or raises an ``APIError``. Whatever happens,
exactly one audit event is recorded (``GenerationCore.record``) and everything claimed is
released: the claims live in one ``Held``, closed here for a whole answer and taken
over by ``GuardedStream`` for a stream, which closes it when the stream ends, fails or is
cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.api import answers, responses_api
from gateway.api.answers import Kind
from gateway.common.errors import APIError, bad_request
from gateway.common.ids import new_generation_id
from gateway.common.json_turns import json_pieces_in_turns
from gateway.config.policies import ModelPolicy
from gateway.core.generation import (
    CLIENT_CANCELLED,
    SERVED,
    ChatPrompt,
    ChoiceStreams,
    GenerationAsk,
    GenerationCore,
    Outcome,
    Prompt,
    TextPrompt,
    TokenPrompt,
    Trace,
    best_of,
)
from gateway.core.held import Held
from gateway.observability.logs import current_generation_id
from gateway.openai.protocol import (
    RESERVED_HEADER_PREFIXES,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway.openai.tokenize import ChatTurn
from gateway.openai.tool_use import output_spec, template_tools
from gateway.server.http_server import (
    DisconnectHook,
    body_timeout_error,
    disconnect_hook,
    header_lines_offered,
    header_pairs,
    response_start,
)
from gateway.server.intake import BodyParser, SpooledBody
from gateway.service.components import Components
from gateway.tenancy.auth import Principal
from gateway.verification.verify import IsolationFailure
from gateway.workers.dispatch import UpstreamStreamError

log = logging.getLogger("isogate.request")

# On every generation response, errors included: a client can find any request's audit event.
GENERATION_ID_HEADER = "X-Generation-Id"
# The same ID under the name the OpenAI SDK reads (``_request_id``); on every response.
REQUEST_ID_HEADER = "X-Request-Id"


async def handle_generation(
    components: Components, scope: Scope, receive: Receive, kind: Kind
) -> Response:
    core = components.core
    trace = Trace(new_generation_id(), datetime.now(UTC), time.perf_counter())
    current_generation_id.set(trace.generation_id)
    held = Held()
    try:
        # auth: a request that fails it is counted, not audited (anyone could write those rows)
        headers = ClientHeaders.of(scope)
        try:
            trace.principal = principal = await _authenticate(components, scope, headers)
        except APIError as error:
            # Not audited, so no generation ID: the request's ID alone.
            response = error.response()
            response.headers[REQUEST_ID_HEADER] = trace.generation_id
            return response
        if principal.is_admin:
            raise APIError(
                403,
                "The admin key cannot run generations; use a tenant key.",
                "permission_error",
                "admin_key_not_allowed",
            )
        if headers.reserved is not None:
            raise bad_request(
                f"Header '{headers.reserved}' is set by the gateway and may not be supplied "
                "by a client.",
                code="reserved_header",
            )

        # The tenant's request counts from here, whatever its body turns out to be.
        limits = components.policies.tenant(principal.tenant_id).limits
        lease = await core.enter(principal.tenant_id, limits, held)

        # parse
        settings = components.settings
        body = await read_large_body(
            scope,
            receive,
            headers.content_length,
            settings.max_body_bytes,
            settings.body_timeout_s,
            components.parser,
        )
        # A Responses request becomes the chat request the core serves (``responses_api``).
        responses_call = None
        parsed: ChatCompletionRequest | CompletionRequest
        if kind == "responses":
            responses_call = await responses_api.parse(components, trace, principal.tenant_id, body)
            parsed = responses_call.chat
        else:
            parsed = await components.parser.parse(
                body, ChatCompletionRequest if kind == "chat" else CompletionRequest
            )
        trace.stream = streaming = parsed.streaming
        trace.model = name = parsed.model
        policies = components.policies
        model = policies.resolve_model(principal.tenant_id, name, principal.models)
        # Served under the name asked for (an alias), audited under both.
        trace.policy_model = model.name
        # max_tokens 0 (an echoed prompt only scored): one token is generated, since a PD
        # pair always decodes one, and dropped.
        max_tokens = max(_max_tokens(parsed, model), 1)
        tokenizer = components.tokenizers[model.name]
        parsed.check_against(tokenizer.vocab_size, max_tokens)
        # Completions per prompt: ``best_of`` of them where a completion request asks for more
        # than it returns.
        candidates = parsed.candidates if isinstance(parsed, CompletionRequest) else parsed.choices
        ask = GenerationAsk(
            tenant_id=principal.tenant_id,
            model=model,
            prompts=_prompts(parsed),
            max_tokens=max_tokens,
            sampling_params=parsed.sampling_params(max_tokens),
            limits=limits,
            lease=lease,
            n=candidates,
            top_logprobs=parsed.top_logprobs_num,
            prompt_logprobs=isinstance(parsed, CompletionRequest) and parsed.scores_prompt,
            stream=streaming,
            output=output_spec(parsed, model)
            if isinstance(parsed, ChatCompletionRequest)
            else None,
        )

        # admit → claim → dispatch → verify (the core), then the response; a client that
        # leaves meanwhile (queued, or waiting on the workers) cancels it
        with ClientWatch(scope, receive):
            admitted = await core.admit(ask, trace, held)
            limit_lines = admitted.lease.header_lines() if admitted.lease is not None else b""
            limit_lines += admitted.budget_lines
            if streaming:
                streams = await core.open_stream(admitted, trace)
                if responses_call is not None:
                    events = responses_api.sse_events(components, responses_call, streams)
                    failure_event = responses_call.failure_event
                else:
                    events = answers.sse_events(
                        trace, streams, kind, parsed.include_usage, parsed.continuous_usage
                    )
                    failure_event = _error_event
                # From here the stream listens for the disconnect itself.
                return GuardedStream(
                    core, trace, events, streams, held.pop_all(), limit_lines, failure_event
                )
            generated = completions = await core.complete(admitted, trace)
        if isinstance(parsed, CompletionRequest) and candidates > parsed.choices:
            completions = best_of(generated, candidates, parsed.choices)
            if parsed.logprobs is None:  # asked for the ranking, not by the client
                completions = [dataclasses.replace(c, logprobs=None) for c in completions]
        if isinstance(parsed, CompletionRequest) and parsed.echo:
            completions = await answers.echoed(parsed, completions, tokenizer)
            if parsed.max_tokens == 0:  # the tokens generated anyway are not the client's
                generated = [dataclasses.replace(c, completion_tokens=0) for c in generated]
        if responses_call is not None:
            result = await responses_api.answer(components, responses_call, trace, completions[0])
        else:
            fingerprint = answers.system_fingerprint(model.name, str(model.tokenizer))
            result = await answers.whole_answer(
                kind, trace, name, fingerprint, completions, generated
            )
        core.record(trace, SERVED)
        listed = "choices" if responses_call is None else "output"
        pieces = await json_pieces_in_turns(result, listed)
        return JSONBodyResponse(pieces, trace.generation_id, limit_lines)
    except IsolationFailure as failure:
        core.record(trace, Outcome.of_failure(failure))
        return _with_generation_id(failure.api_error().response(), trace)
    except APIError as error:
        core.record(trace, Outcome.of_error(error))
        return _with_generation_id(error.response(), trace)
    except ClientDisconnect:
        core.record(trace, CLIENT_CANCELLED)
        cancelled = APIError(
            499, "The client went away.", "invalid_request_error", "client_cancelled"
        )
        return _with_generation_id(cancelled.response(), trace)
    except asyncio.CancelledError:
        # The client went away while we waited on a worker: still exactly one event.
        core.record(trace, CLIENT_CANCELLED)
        raise
    except Exception as exc:
        log.exception("unexpected error serving a generation")
        core.record(trace, Outcome("upstream_error", 500, "internal_error", type(exc).__name__))
        internal = APIError(500, "Internal error.", "server_error", "internal_error")
        return _with_generation_id(internal.response(), trace)
    finally:
        await held.aclose()  # empty once a stream has taken the claims over


async def _client_left(receive: Receive) -> None:
    """Returns never; raises ``ClientDisconnect`` once the client has gone (the body is read
    by then, so the only message left to come is the disconnect)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            raise ClientDisconnect()


class ClientWatch:
    """While inside: the client hanging up cancels the task serving it, and the cancellation
    comes out of the ``with`` as ``ClientDisconnect``. (A plain ``with``: neither end awaits
    anything, so neither needs a coroutine made and run per request.)

    Cancelling is how a request is given up everywhere below: a queued one leaves its queue,
    one on the workers is aborted on both (``gateway.workers.dispatch``), and the claims are
    released on the way out. The work runs in the request's own task. Under the gateway's
    own server the connection's ``DisconnectHook`` calls back when it is lost; under any
    other ASGI server a watcher task waits on ``receive()`` for the disconnect.
    """

    __slots__ = ("_hook", "_receive", "_served", "_watcher", "left")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._hook = disconnect_hook(scope)
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None
        self.left = False

    def __enter__(self) -> ClientWatch:
        served = asyncio.current_task()
        assert served is not None  # a request is always served by a task
        self._served = served
        hook = self._hook
        if hook is None:
            self._watcher = asyncio.ensure_future(_client_left(self._receive))
            self._watcher.add_done_callback(self._on_watcher_done)
        elif hook.gone:
            raise ClientDisconnect()
        else:
            hook.callback = self._on_client_left
        return self

    def _on_client_left(self) -> None:
        self.left = True
        self._served.cancel()

    def _on_watcher_done(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled() and isinstance(watcher.exception(), ClientDisconnect):
            self._on_client_left()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        watcher = self._watcher
        if watcher is not None:
            watcher.remove_done_callback(self._on_watcher_done)
            watcher.cancel()
        elif self._hook is not None:
            self._hook.callback = None
        # The served task can only have been cancelled while it waited inside the block, so
        # the cancellation is what leaves it.
        if self.left and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            self._served.uncancel()
            raise ClientDisconnect() from None


async def _authenticate(components: Components, scope: Scope, headers: ClientHeaders) -> Principal:
    client = scope.get("client")  # behind a trusted proxy, the client it forwards
    return await components.unauthenticated.authenticate(
        components.authenticator, headers.authorization, client[0] if client else ""
    )


def _with_generation_id(response: Response, trace: Trace) -> Response:
    response.headers[GENERATION_ID_HEADER] = trace.generation_id
    response.headers[REQUEST_ID_HEADER] = trace.generation_id
    return response


@dataclass(slots=True)  # built per request: not frozen (see gateway.core.generation)
class ClientHeaders:
    """The request headers the pipeline reads, found in one pass over the raw ASGI list.

    (Starlette's ``Headers`` searches the whole list again for each name it is asked for.)
    """

    authorization: str | None
    content_length: str | None
    reserved: str | None  # the first header only the gateway may set, if the client sent one

    @classmethod
    def of(cls, scope: Scope) -> ClientHeaders:
        headers = scope["headers"]  # lower-case names (ASGI); the first of a name counts
        # The lookups in C, not a Python loop over every header: a dict of each name's first
        # value, and one search of the names joined for a reserved prefix.
        first = dict(reversed(headers))
        authorization, content_length = first.get(b"authorization"), first.get(b"content-length")
        reserved = None
        if _RESERVED_NAME.search(b"\n" + b"\n".join(first)) is not None:
            reserved = next(
                (n.decode("latin-1") for n, _ in headers if n.startswith(_RESERVED_PREFIXES)), None
            )
        return cls(
            None if authorization is None else authorization.decode("latin-1"),
            None if content_length is None else content_length.decode("latin-1"),
            reserved,
        )


_RESERVED_PREFIXES = tuple(prefix.encode() for prefix in RESERVED_HEADER_PREFIXES)
# A name that starts with a reserved prefix, in the names joined by newlines (none holds one).
_RESERVED_NAME = re.compile(b"\n(?:" + b"|".join(map(re.escape, _RESERVED_PREFIXES)) + b")")


async def read_body(
    scope: Scope, receive: Receive, declared_length: str | None, limit: int, timeout_s: float
) -> bytes:
    """The whole body, a 413 as soon as it is known to exceed ``limit`` bytes, or a 408 (and
    the connection closed) if it has not all arrived within ``timeout_s``."""
    body = await read_large_body(scope, receive, declared_length, limit, timeout_s, None)
    assert isinstance(body, bytes)  # nothing is spooled without a spool
    return body


def read_large_body(
    scope: Scope,
    receive: Receive,
    declared_length: str | None,
    limit: int,
    timeout_s: float,
    parser: BodyParser | None,
) -> Awaitable[bytes | SpooledBody]:
    """``read_body``, but a body of at least ``parser.spill_at`` bytes is written to a file as
    it arrives (``gateway.server.intake``) instead of being joined in memory. Not a coroutine itself
    under the gateway's own server: each wait for the body would resume one frame more."""
    hook = disconnect_hook(scope)
    if hook is not None:  # the gateway's own server times the body out itself
        return _read_body(receive, declared_length, limit, parser, hook)
    return _read_body_in_time(receive, declared_length, limit, timeout_s, parser)


async def _read_body_in_time(
    receive: Receive,
    declared_length: str | None,
    limit: int,
    timeout_s: float,
    parser: BodyParser | None,
) -> bytes | SpooledBody:
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(receive, declared_length, limit, parser, None)
    except TimeoutError:
        error = body_timeout_error(timeout_s)
        error.headers["Connection"] = "close"  # the app's answer: the server closes after it
        raise error from None


async def _read_body(
    receive: Receive,
    declared_length: str | None,
    limit: int,
    parser: BodyParser | None,
    hook: DisconnectHook | None,
) -> bytes | SpooledBody:
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    spooled: SpooledBody | None = None
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if hook is not None and hook.refused is not None:
                    raise hook.refused  # answered already, by the server
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if spooled is not None:
                spooled.write(chunk)
            elif parser is not None and size >= parser.spill_at:
                spooled = parser.spool()
                for earlier in chunks:
                    spooled.write(earlier)
                spooled.write(chunk)
                chunks = []
            else:
                chunks.append(chunk)
            if not message.get("more_body", False):
                if spooled is not None:
                    return spooled
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except BaseException:
        if spooled is not None:
            spooled.discard()
        raise


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"Request body exceeds {limit} bytes.", "invalid_request_error", "request_too_large"
    )


class JSONBodyResponse(Response):
    """A served response: JSON bytes (or pieces of them, sent one after the other) with their
    length, the generation ID and ``extra_lines`` (header lines, ``name: value\\r\\n`` each).

    The head is made by one format operation, as header lines where the gateway's own server
    takes them (``gateway.server.http_server``), else as the pairs they stand for; not by
    ``Response.__init__``, which rebuilds headers from a dict for every response.
    """

    def __init__(
        self, body: bytes | list[bytes], generation_id: str, extra_lines: bytes = b""
    ) -> None:
        self.status_code = 200
        self.background = None
        self.pieces = [body] if isinstance(body, bytes) else body
        id_ = generation_id.encode()
        length = sum(map(len, self.pieces))
        self._lines = _SERVED_HEAD % (length, id_, id_) + extra_lines

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """As Starlette's responses hold them, made from the lines when asked for: a copy, so
        a change goes through the setter (``headers[...] = ...`` would be lost)."""
        return header_pairs(self._lines)

    @raw_headers.setter
    def raw_headers(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self._lines = b"".join(b"%s: %s\r\n" % pair for pair in pairs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(response_start(200, [], self._lines, lines_taken=header_lines_offered(scope)))
        last = len(self.pieces) - 1
        for index, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": index < last})


# A stream's own header lines (its type is Starlette's): no caching or proxy buffering, and
# its generation ID (twice: as the request's ID too).
_STREAM_HEAD = (
    b"cache-control: no-cache\r\nx-accel-buffering: no\r\n"
    b"x-generation-id: %s\r\nx-request-id: %s\r\n"
)
# The served answer's own header lines: its type, length and generation ID (as the request's).
_SERVED_HEAD = (
    b"content-type: application/json\r\ncontent-length: %d\r\n"
    b"x-generation-id: %s\r\nx-request-id: %s\r\n"
)


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


def _prompts(parsed: ChatCompletionRequest | CompletionRequest) -> list[Prompt]:
    if isinstance(parsed, ChatCompletionRequest):
        messages = parsed.messages
        continuation = parsed.continuation()
        if continuation is not None:  # the final assistant message is continued, not rendered
            messages = messages[:-1]
        turns = [ChatTurn(m.role, m.text(), m.template_fields()) for m in messages]
        return [
            ChatPrompt(
                turns,
                template_tools(parsed),
                template_kwargs=parsed.template_kwargs(),
                # As SGLang: a continuation always follows the generation prompt.
                generation_prompt=parsed.add_generation_prompt is not False
                or continuation is not None,
                continuation=continuation,
            )
        ]
    return [
        TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(prompt)
        for prompt in parsed.prompts()
    ]


# ---- streaming ---------------------------------------------------------------------------


def _error_event(error: APIError) -> bytes:
    """A chat or completion stream's end after a failure: one OpenAI-format error event."""
    return answers.sse_event(error.body())


class GuardedStream(StreamingResponse):
    """An SSE response that always audits and releases, however the stream ends.

    Starlette's streaming response pumps the events and stops when the client disconnects;
    this one adds what happens after: decode's stream is closed, the claims (``held``) are
    released and the one audit event is recorded, on every exit path. A failure after the
    first byte cannot change the status any more: the stream ends with one OpenAI-format error
    event and nothing else (no ``[DONE]``), so a client never mistakes a withheld response for
    a complete one.
    """

    def __init__(
        self,
        core: GenerationCore,
        trace: Trace,
        events: AsyncGenerator[bytes],
        streams: ChoiceStreams,
        held: Held,
        extra_lines: bytes = b"",
        failure_event: Callable[[APIError], bytes] | None = None,
    ) -> None:
        self._guarded_events = self._guarded(events)
        # How a failure after the first byte is told (the API's error event).
        self._failure_event = failure_event or _error_event
        super().__init__(self._guarded_events, media_type="text/event-stream")
        # The rest of the head as header lines (as ``JSONBodyResponse`` makes them).
        id_ = trace.generation_id.encode()
        self._lines = _STREAM_HEAD % (id_, id_) + extra_lines
        self._lines_offered = False
        self._core = core
        self._trace = trace
        self._events = events
        self._streams = streams
        self._held = held
        # Until the stream is seen to its end, the client went away.
        self._outcome = CLIENT_CANCELLED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._lines_offered = header_lines_offered(scope)
        try:
            await self._pump_until_disconnected(scope, receive, send)
        finally:
            try:
                await self._guarded_events.aclose()
                await self._events.aclose()
                await self._streams.aclose()
            finally:
                await self._held.aclose()
                self._core.record(self._trace, self._outcome)

    async def _pump_until_disconnected(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's own pump (``stream_response``), ended when the client goes, as
        ``StreamingResponse.__call__`` ends it; the wait for the disconnect is ``ClientWatch``'s
        (under the gateway's own server a callback, no task of its own), not an anyio task
        group, whose cancel scopes, task names and library sniffing cost more CPU per stream
        than the rest of the stream's own work."""
        # A client gone: the outcome stays CLIENT_CANCELLED.
        with contextlib.suppress(ClientDisconnect), ClientWatch(scope, receive):
            await self.stream_response(send)

    async def stream_response(self, send: Send) -> None:
        """Starlette's pump, with the head's lines where the server takes them."""
        await send(
            response_start(
                self.status_code, self.raw_headers, self._lines, lines_taken=self._lines_offered
            )
        )
        async for event in self._guarded_events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _guarded(self, events: AsyncGenerator[bytes]) -> AsyncGenerator[bytes]:
        try:
            async for event in events:
                yield event
            self._outcome = SERVED
        except IsolationFailure as failure:
            yield self._failure_event(failure.api_error())
            self._outcome = Outcome.of_failure(failure, status=200)
        except (APIError, UpstreamStreamError) as error:
            api_error = (
                error
                if isinstance(error, APIError)
                else APIError(  # the engine's own text is in the log (gateway.workers.dispatch)
                    502,
                    "The decode worker failed mid-stream.",
                    "upstream_error",
                    "upstream_error",
                )
            )
            yield self._failure_event(api_error)
            self._outcome = Outcome("upstream_error", 200, api_error.code, api_error.message[:300])
