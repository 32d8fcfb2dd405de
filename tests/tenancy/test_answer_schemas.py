"""The admin and audit routes' answers conform to the models /openapi.json is generated from.

The handlers build their answers as plain dicts (``gateway.tenancy.store``'s ``to_json`` and
``audit_row_json``, ``admin_routes``); ``gateway.api.openapi`` describes them with models. Every
kind of answer each route gives, read over HTTP (ASGI) from a real database (PostgreSQL and
SQLite), must validate with its model strictly and with the served document
(``tests.schemas.assert_conforms``), so the description cannot drift from the routes.
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from gateway.api.openapi import (
    ApiKey,
    ApiKeyCreated,
    ApiKeyList,
    AuditEvent,
    AuditEventList,
    Tenant,
    TenantList,
)
from gateway.openai.protocol import ErrorResponse
from gateway.tenancy.store import OUTCOMES, Store
from tests.schemas import assert_conforms

from .conftest import admin_headers

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)


async def answer(
    api: httpx.AsyncClient,
    method: str,
    path: str,
    status: int,
    *,
    json: object = None,
    content: bytes | None = None,
) -> object:
    response = await api.request(method, path, headers=admin_headers(), json=json, content=content)
    assert response.status_code == status, response.text
    return response.json()


async def test_tenant_and_key_answers_conform(api: httpx.AsyncClient) -> None:
    assert_conforms(Tenant, await answer(api, "POST", "/admin/tenants", 201, json={"id": "acme"}))
    named = await answer(api, "POST", "/admin/tenants", 201, json={"id": "beta", "name": "Beta"})
    assert_conforms(Tenant, named)
    assert_conforms(TenantList, await answer(api, "GET", "/admin/tenants", 200))
    assert_conforms(Tenant, await answer(api, "GET", "/admin/tenants/acme", 200))
    assert_conforms(Tenant, await answer(api, "POST", "/admin/tenants/acme/disable", 200))
    assert_conforms(Tenant, await answer(api, "POST", "/admin/tenants/acme/enable", 200))

    created = await answer(api, "POST", "/admin/tenants/acme/keys", 201, json={"name": "ci"})
    assert_conforms(ApiKeyCreated, created)
    unnamed = await answer(api, "POST", "/admin/tenants/acme/keys", 201)
    assert_conforms(ApiKeyCreated, unnamed)
    assert isinstance(created, dict) and isinstance(unnamed, dict)
    assert_conforms(ApiKey, await answer(api, "GET", f"/admin/keys/{created['id']}", 200))
    revoked = await answer(api, "POST", f"/admin/keys/{created['id']}/revoke", 200)
    assert_conforms(ApiKey, revoked)
    assert isinstance(revoked, dict) and revoked["revoked_at"] is not None
    assert_conforms(ApiKey, await answer(api, "DELETE", f"/admin/keys/{unnamed['id']}", 200))
    assert_conforms(ApiKeyList, await answer(api, "GET", "/admin/tenants/acme/keys", 200))
    every_key = await answer(api, "GET", "/admin/keys", 200)
    assert_conforms(ApiKeyList, every_key)
    assert isinstance(every_key, dict) and len(every_key["data"]) == 2
    assert_conforms(ApiKeyList, await answer(api, "GET", "/admin/keys?tenant=beta", 200))


async def test_failure_answers_of_the_admin_routes_conform(api: httpx.AsyncClient) -> None:
    await answer(api, "POST", "/admin/tenants", 201, json={"id": "acme"})
    failures = [
        await answer(api, "POST", "/admin/tenants", 409, json={"id": "acme"}),
        await answer(api, "POST", "/admin/tenants", 400, json={"id": "Not Valid"}),
        await answer(api, "POST", "/admin/tenants", 400, content=b"[1]"),
        await answer(api, "GET", "/admin/tenants/nobody", 404),
        await answer(api, "GET", "/admin/keys?color=red", 400),
        (await api.get("/admin/tenants")).json(),  # no key: 401
    ]
    for failure in failures:
        assert_conforms(ErrorResponse, failure)


def audit_row(generation_id: str, outcome: str, *, complete: bool) -> dict[str, object]:
    """A served request's full record, or a refusal's with every optional field empty."""
    return dict(
        generation_id=generation_id,
        tenant_id="acme",
        key_id="key_x" if complete else None,
        model="m1" if complete else None,
        outcome=outcome,
        status=200 if complete else 429,
        code=None if complete else "rate_limit_exceeded",
        prefill_worker="http://p:1" if complete else None,
        decode_worker="http://d:2" if complete else None,
        prompt_tokens=7 if complete else None,
        completion_tokens=3 if complete else None,
        stream=complete,
        latency_ms=12.5 if complete else 0.25,
        created_at=T0,
        detail=None if complete else "over the limit",
    )


async def test_audit_answers_conform(api: httpx.AsyncClient, store: Store) -> None:
    store.insert_audit_rows(
        [audit_row(f"gen-{i}", outcome, complete=i % 2 == 0) for i, outcome in enumerate(OUTCOMES)]
    )
    every = await answer(api, "GET", "/v1/audit/events", 200)
    assert_conforms(AuditEventList, every)
    assert isinstance(every, dict) and every["next_cursor"] is None
    assert {event["outcome"] for event in every["data"]} == set(OUTCOMES)
    page = await answer(api, "GET", "/v1/audit/events?limit=1", 200)
    assert_conforms(AuditEventList, page)
    assert isinstance(page, dict) and isinstance(page["next_cursor"], str)
    for event in every["data"]:
        one = await answer(api, "GET", f"/v1/audit/events/{event['generation_id']}", 200)
        assert_conforms(AuditEvent, one)
    assert_conforms(ErrorResponse, await answer(api, "GET", "/v1/audit/events/nothing", 404))
    assert_conforms(ErrorResponse, await answer(api, "GET", "/v1/audit/events?limit=0", 400))
