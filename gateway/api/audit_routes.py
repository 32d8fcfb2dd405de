"""``GET /v1/audit/events``: the audit log, newest first, for a tenant's key or the admin key.

A tenant key sees only its own tenant's events. Its tenant is a condition of the SQL query
itself, not a filter applied afterwards, so no combination of parameters widens it. A
tenant key that names another tenant in ``tenant=`` gets 403 (naming its own is allowed).
The admin key sees every tenant's events, or one tenant's with ``tenant=``.

Query parameters (any other is a 400, so a misspelt filter is never silently ignored):
``since`` (inclusive) and ``until`` (exclusive), RFC 3339 with an offset; ``outcome``;
``model``; ``generation_id`` (the ``id`` a response carried); ``limit`` 1..1000 (default
100); ``cursor``, the opaque ``next_cursor`` of the previous page (keyset on
``(created_at, generation_id)``, so pages stay stable while events are being added).

``GET /v1/audit/events/{generation_id}`` returns one event; 404 when it does not exist or
belongs to another tenant (the two are indistinguishable to a tenant, on purpose).

Events this replica has recorded but not yet written are written before a query runs, so a
request's event can be looked up as soon as its response arrived (on the replica that
served it; other replicas see it within ``audit_flush_interval_s``).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.common.errors import bad_request, forbidden, not_found, quoted, unavailable
from gateway.tenancy.store import OUTCOMES, AuditQuery, audit_row_json, decode_cursor

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
_PARAMETERS = {"tenant", "since", "until", "outcome", "model", "generation_id", "limit", "cursor"}


def audit_routes() -> list[BaseRoute]:
    return [
        Route("/v1/audit/events", list_events, methods=["GET"]),
        Route("/v1/audit/events/{generation_id}", get_event, methods=["GET"]),
    ]


async def list_events(request: Request) -> Response:
    components = request.app.state.components
    principal = await components.authenticator.authenticate(request.headers.get("authorization"))
    params = request.query_params
    for name in params:
        if name not in _PARAMETERS:
            raise bad_request(f"Unknown query parameter {quoted(name)}.", param=name)
    for name in _PARAMETERS:
        if len(params.getlist(name)) > 1:
            raise bad_request(f"Query parameter {quoted(name)} given more than once.", param=name)
    tenant = params.get("tenant")
    if principal.is_admin:
        tenant_id = tenant or None
    else:
        if tenant is not None and tenant != principal.tenant_id:
            raise forbidden("A tenant key can read only its own tenant's audit events.")
        tenant_id = principal.tenant_id
    query = AuditQuery(
        tenant_id=tenant_id,
        since=parse_time(params.get("since"), "since"),
        until=parse_time(params.get("until"), "until"),
        outcome=parse_outcome(params.get("outcome")),
        model=params.get("model"),
        generation_id=params.get("generation_id"),
        limit=parse_limit(params.get("limit")),
        after=parse_cursor(params.get("cursor")),
    )
    if query.since is not None and query.until is not None and query.since >= query.until:
        raise bad_request("'since' must be earlier than 'until'.", param="since")
    rows, next_cursor = await _query(components, query)
    return _json(
        {
            "object": "list",
            "data": [audit_row_json(r, admin=principal.is_admin) for r in rows],
            "next_cursor": next_cursor,
        }
    )


async def get_event(request: Request) -> Response:
    components = request.app.state.components
    principal = await components.authenticator.authenticate(request.headers.get("authorization"))
    generation_id = request.path_params["generation_id"]
    query = AuditQuery(
        tenant_id=None if principal.is_admin else principal.tenant_id,
        generation_id=generation_id,
        limit=1,
    )
    rows, _ = await _query(components, query)
    if not rows:
        raise not_found(f"No audit event {quoted(generation_id)}.", param="generation_id")
    return _json(audit_row_json(rows[0], admin=principal.is_admin))


def parse_time(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise bad_request(
            f"'{name}' must be an RFC 3339 time, e.g. 2026-11-29T16:00:00Z.", param=name
        ) from exc
    if moment.tzinfo is None:
        raise bad_request(f"'{name}' needs a UTC offset (e.g. 'Z' or '+00:00').", param=name)
    return moment


def parse_outcome(value: str | None) -> str | None:
    if value is not None and value not in OUTCOMES:
        raise bad_request(f"'outcome' must be one of {', '.join(OUTCOMES)}.", param="outcome")
    return value


def parse_limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"'limit' must be an integer from 1 to {MAX_LIMIT}.", param="limit")
    return limit


def parse_cursor(value: str | None) -> tuple[datetime, str] | None:
    if value is None:
        return None
    try:
        return decode_cursor(value)
    except ValueError as exc:
        raise bad_request("'cursor' is not a cursor this API returned.", param="cursor") from exc


async def _query(components: Any, query: AuditQuery) -> tuple[list[dict[str, Any]], str | None]:
    # Read your writes: events this replica recorded but has not written yet (at most one
    # flush interval's worth) are written first, so a response's id is found at once.
    audit = getattr(components, "audit", None)
    if audit is not None and audit.queued:
        await audit.flush()
    try:
        return await asyncio.to_thread(components.store.query_audit, query)
    except SQLAlchemyError as exc:
        raise unavailable(
            "The audit store is unavailable; try again.", code="audit_store_unavailable"
        ) from exc


def _json(payload: object) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")
