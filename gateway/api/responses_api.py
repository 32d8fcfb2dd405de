"""The Responses API's HTTP side: ``POST /v1/responses`` through the generation pipeline, and
the tenant's stored responses (``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``).

A Responses request takes the pipeline's one path (``gateway.api.pipeline.handle_generation``
with kind "responses"): auth, the body, the tenant's limits, the core (admit, claim,
dispatch, verify), held claims and one audit event, under the response's id (its generation
ID). Two steps are this module's: ``parse`` turns the body (and the conversation its
``previous_response_id`` names, read in the tenant's own rows only) into the chat request the
core serves, and ``answer`` / ``sse_events`` turn the checked completion into the Response
object or its semantic stream, storing it (``store``) before its last event goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.api import answers
from gateway.common.errors import APIError, bad_request, forbidden, unavailable
from gateway.common.json_turns import json_in_turns
from gateway.core.generation import ChoiceStreams, Completion, StreamEnd, Trace
from gateway.core.held import Held
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.responses import (
    LOGPROBS_INCLUDE,
    ResponseEvents,
    ResponsesRequest,
    as_context,
    canonical_items,
    chat_request,
    deleted,
    finish_status,
    input_item_page,
    output_items,
    response_not_found,
    response_object,
    text_logprob,
    usage_of,
)
from gateway.openai.tool_use import new_tool_call_id
from gateway.service.components import Components
from gateway.tenancy.stored_responses import StoredResponse

log = logging.getLogger("isogate.request")

_T = TypeVar("_T")

# input_items' page size, as OpenAI's: 20 by default, at most 100.
DEFAULT_PAGE, MAX_PAGE = 20, 100
_INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
    }
)


@dataclass(slots=True)
class ResponsesCall:
    """One Responses request on its way through the pipeline."""

    request: ResponsesRequest
    tenant_id: str
    items: list[dict[str, Any]]  # this request's input, canonical
    context: list[dict[str, Any]]  # the conversation previous_response_id brings in
    chat: ChatCompletionRequest  # what the core serves
    events: ResponseEvents  # the stream's, when it streams
    created_at: datetime

    def failure_event(self, error: APIError) -> bytes:
        """How a stream that fails after its first byte ends (``GuardedStream``)."""
        opened = self.events.created() if self.events.sequence == 0 else b""
        return opened + self.events.failed(error)


async def parse(components: Components, trace: Trace, tenant_id: str, body: Any) -> ResponsesCall:
    """The body as a Responses request, and the chat request the core serves for it: its
    input after the tenant's stored conversation that ``previous_response_id`` names (a 404,
    the same as for a missing one, for any id that is not the tenant's own live response)."""
    request: ResponsesRequest = await components.parser.parse(body, ResponsesRequest)
    context: list[dict[str, Any]] = []
    previous = request.previous_response_id
    if previous is not None:
        found = await _stored(components.responses.context, tenant_id, previous)
        if found is None:
            error = response_not_found(previous)
            error.param = "previous_response_id"
            raise error
        context = found
    items = canonical_items(request)
    return ResponsesCall(
        request,
        tenant_id,
        items,
        context,
        chat_request(request, context, items),
        ResponseEvents(request, trace.generation_id, int(trace.created_at.timestamp())),
        trace.created_at,
    )


async def answer(
    components: Components, call: ResponsesCall, trace: Trace, completion: Completion
) -> dict[str, Any]:
    """The Response object of a whole answer, stored first where the request says so."""
    status, reason = finish_status(completion.finish_reason)
    calls = [(new_tool_call_id(), c.name, c.arguments) for c in completion.tool_calls or ()]
    logprobs = None
    if completion.logprobs:
        logprobs = await json_in_turns(
            completion.logprobs, text_logprob, answers.per_turn(completion.logprobs)
        )
    output = output_items(completion.text, completion.reasoning, calls, status, logprobs)
    response = response_object(
        call.request,
        id=trace.generation_id,
        created_at=call.events.created_at,
        status=status,
        output=output,
        usage=usage_of(
            completion.prompt_tokens, completion.completion_tokens, completion.cached_tokens
        ),
        completed_at=_now_s(),
        incomplete_reason=reason,
    )
    await _store(components, call, response)
    return response


async def sse_events(
    components: Components, call: ResponsesCall, streams: ChoiceStreams
) -> AsyncGenerator[bytes]:
    """The response's semantic events: created and in progress, then each output item as its
    checked parts arrive, then completed (or incomplete), once the response is stored. What
    is ready together goes out in one write, but for the events that close the output: each
    goes alone, the loop free between two (a long answer's log probabilities are in three)."""
    events = call.events
    pending = events.created()
    end: StreamEnd | None = None
    async for _, item in streams.events():
        if isinstance(item, StreamEnd):
            end, text = item, item.tail
        else:
            text = item.delta
        pending += events.reasoning(item.reasoning)
        pending += events.text(text, item.logprobs)
        for tool_call in item.tool_calls or ():
            pending += events.call(tool_call.name, tool_call.arguments, new_tool_call_id())
        if pending and end is None:
            yield pending
            pending = b""
    assert end is not None  # a stream always ends with its end
    for event in events.closing(end.finish_reason):
        yield pending + event
        pending = b""
        await asyncio.sleep(0)
    usage = usage_of(streams.prompt_tokens, end.completion_tokens, end.cached_tokens)
    response, last = events.finished(end.finish_reason, usage, _now_s())
    await _store(components, call, response)
    yield pending + last


async def _store(components: Components, call: ResponsesCall, response: dict[str, Any]) -> None:
    request = call.request
    if not request.stored:
        return
    retention = components.policies.tenant(call.tenant_id).response_retention_days
    record = StoredResponse(
        id=response["id"],
        tenant_id=call.tenant_id,
        model=request.model,
        created_at=call.created_at,
        expires_at=call.created_at + timedelta(days=retention),
        response=response,
        input_items=call.items,
        context=[*call.context, *call.items, *as_context(response["output"])],
    )
    try:
        await asyncio.to_thread(components.responses.save, record)
    except Exception:
        log.exception("storing a response failed")
        raise unavailable(
            "The response could not be stored; try again (or send store: false).",
            code="store_unavailable",
        ) from None


async def _stored(read: Callable[[str, str], _T], tenant_id: str, response_id: str) -> _T:
    try:
        return await asyncio.to_thread(read, tenant_id, response_id)
    except Exception:
        log.exception("reading stored responses failed")
        raise unavailable(
            "Stored responses cannot be read now; try again.", code="store_unavailable"
        ) from None


def _now_s() -> int:
    return int(time.time())


# ---- the stored responses' routes ---------------------------------------------------------


@contextlib.asynccontextmanager
async def _tenant(request: Request) -> AsyncIterator[tuple[Components, str]]:
    """The asking tenant, its request counted against its limits (requests per minute and
    concurrency, as every route that does work for a tenant) until the answer is built."""
    components, tenant_id = await _authenticated(request)
    async with Held() as held:
        limits = components.policies.tenant(tenant_id).limits
        await components.core.enter(tenant_id, limits, held)
        yield components, tenant_id


async def _authenticated(request: Request) -> tuple[Components, str]:
    components: Components = request.app.state.components
    client = request.scope.get("client")
    principal = await components.unauthenticated.authenticate(
        components.authenticator,
        request.headers.get("authorization"),
        client[0] if client else "",
    )
    if principal.is_admin:
        raise forbidden("Stored responses are a tenant's; use the tenant's key.")
    return components, principal.tenant_id


def _json(payload: object) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


async def retrieve(request: Request) -> Response:
    """The tenant's stored response, as it was answered."""
    async with _tenant(request) as (components, tenant_id):
        response_id = request.path_params["response_id"]
        found = await _stored(components.responses.response_json, tenant_id, response_id)
    if found is None:
        raise response_not_found(response_id)
    return Response(found, media_type="application/json")


async def delete(request: Request) -> Response:
    async with _tenant(request) as (components, tenant_id):
        response_id = request.path_params["response_id"]
        removed = await _stored(components.responses.delete, tenant_id, response_id)
    if not removed:
        raise response_not_found(response_id)
    return _json(deleted(response_id))


async def input_items(request: Request) -> Response:
    """The input items of the tenant's stored response, a page at a time."""
    async with _tenant(request) as (components, tenant_id):
        response_id = request.path_params["response_id"]
        query = request.query_params
        limit_text = query.get("limit", str(DEFAULT_PAGE))
        if (
            not limit_text.isascii()
            or not limit_text.isdigit()
            or not 1 <= int(limit_text) <= MAX_PAGE
        ):
            raise bad_request(
                f"limit is a whole number from 1 to {MAX_PAGE}.",
                code="invalid_value",
                param="limit",
            )
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order is 'asc' or 'desc'.", code="invalid_value", param="order")
        for value in query.getlist("include") + query.getlist("include[]"):
            if value not in _INCLUDABLE:
                raise bad_request(
                    f"Unknown include value {value[:64]!r}.", code="invalid_value", param="include"
                )
        found = await _stored(components.responses.input_items, tenant_id, response_id)
    if found is None:
        raise response_not_found(response_id)
    return _json(
        input_item_page(found, after=query.get("after"), limit=int(limit_text), order=order)
    )


def responses_routes() -> list[BaseRoute]:
    """The stored responses' routes (``POST /v1/responses`` is a generation route)."""
    return [
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
    ]
