"""``/admin/...``: tenants and their API keys. The admin key only.

    POST   /admin/tenants                   {"id", "name"?}  → 201 tenant (409 if it exists)
    GET    /admin/tenants                                    → list of tenants
    GET    /admin/tenants/{tenant_id}                        → tenant
    POST   /admin/tenants/{tenant_id}/disable | /enable      → tenant
    POST   /admin/tenants/{tenant_id}/keys  {"name"?, "models"?} → 201 key, the raw "key" (once)
    GET    /admin/tenants/{tenant_id}/keys                   → list of that tenant's keys
    GET    /admin/keys[?tenant=...]                          → list of keys
    GET    /admin/keys/{key_id}                              → key
    POST   /admin/keys/{key_id}/revoke  (or DELETE /admin/keys/{key_id}) → key, revoked

Disabling a tenant and revoking a key take effect at once in this process and, through
Redis, in every other replica (``gateway.tenancy.revocations``; without Redis, within
``auth_cache_ttl_s``). Store calls are blocking, so they run in a thread.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.common.errors import APIError, bad_request, not_found, quoted, unavailable
from gateway.tenancy.store import StoreConflict, StoreNotFound

TENANT_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_MAX_NAME_CHARS = 200


def admin_routes() -> list[BaseRoute]:
    return [
        Route("/admin/tenants", create_tenant, methods=["POST"]),
        Route("/admin/tenants", list_tenants, methods=["GET"]),
        Route("/admin/tenants/{tenant_id}", get_tenant, methods=["GET"]),
        Route("/admin/tenants/{tenant_id}/disable", disable_tenant, methods=["POST"]),
        Route("/admin/tenants/{tenant_id}/enable", enable_tenant, methods=["POST"]),
        Route("/admin/tenants/{tenant_id}/keys", create_key, methods=["POST"]),
        Route("/admin/tenants/{tenant_id}/keys", list_tenant_keys, methods=["GET"]),
        Route("/admin/keys", list_keys, methods=["GET"]),
        Route("/admin/keys/{key_id}", get_key, methods=["GET"]),
        Route("/admin/keys/{key_id}", revoke_key, methods=["DELETE"]),
        Route("/admin/keys/{key_id}/revoke", revoke_key, methods=["POST"]),
    ]


async def create_tenant(request: Request) -> Response:
    components = await _admin(request)
    body = await _json_object(request, allowed={"id", "name"})
    tenant_id = body.get("id")
    if not isinstance(tenant_id, str) or not TENANT_ID_PATTERN.match(tenant_id):
        raise bad_request(
            (
                "'id' must be 1-64 characters of a-z, 0-9, '_', '.', '-', "
                "starting with a letter or digit."
            ),
            param="id",
        )
    name = _optional_name(body)
    try:
        tenant = await _call(components.store.create_tenant, tenant_id, name)
    except StoreConflict as exc:
        raise _conflict(str(exc), "id") from exc
    return _json(tenant.to_json(), 201)


async def list_tenants(request: Request) -> Response:
    components = await _admin(request)
    tenants = await _call(components.store.list_tenants)
    return _json({"object": "list", "data": [t.to_json() for t in tenants]})


async def get_tenant(request: Request) -> Response:
    components = await _admin(request)
    tenant = await _call(components.store.get_tenant, request.path_params["tenant_id"])
    return _json(tenant.to_json())


async def disable_tenant(request: Request) -> Response:
    components = await _admin(request)
    tenant_id = request.path_params["tenant_id"]
    tenant = await _call(components.store.set_tenant_disabled, tenant_id, True)
    await components.revocations.tenant_changed(tenant_id)
    return _json(tenant.to_json())


async def enable_tenant(request: Request) -> Response:
    components = await _admin(request)
    tenant_id = request.path_params["tenant_id"]
    tenant = await _call(components.store.set_tenant_disabled, tenant_id, False)
    await components.revocations.tenant_changed(tenant_id)
    return _json(tenant.to_json())


async def create_key(request: Request) -> Response:
    components = await _admin(request)
    body = await _json_object(request, allowed={"name", "models"})
    name = _optional_name(body)
    models = body.get("models")
    if models is not None and (
        not isinstance(models, list)
        or not all(isinstance(m, str) and m in components.policies.models for m in models)
    ):
        # Narrowing to a model that does not exist is a mistake, not a key for nothing.
        raise bad_request(
            "'models' must be a list of models' names (models.yaml), if given.", param="models"
        )
    raw_key, record = await _call(
        components.store.create_key, request.path_params["tenant_id"], name, models
    )
    # The only time the raw key leaves the gateway; only its hash is stored.
    return _json({**record.to_json(), "key": raw_key}, 201)


async def list_tenant_keys(request: Request) -> Response:
    components = await _admin(request)
    tenant_id = request.path_params["tenant_id"]
    await _call(components.store.get_tenant, tenant_id)  # 404 for an unknown tenant
    keys = await _call(components.store.list_keys, tenant_id)
    return _json({"object": "list", "data": [k.to_json() for k in keys]})


async def list_keys(request: Request) -> Response:
    components = await _admin(request)
    unknown = set(request.query_params) - {"tenant"}
    if unknown:
        raise bad_request(
            f"Unknown query parameter {quoted(sorted(unknown)[0])}.", param=sorted(unknown)[0]
        )
    keys = await _call(components.store.list_keys, request.query_params.get("tenant"))
    return _json({"object": "list", "data": [k.to_json() for k in keys]})


async def get_key(request: Request) -> Response:
    components = await _admin(request)
    key = await _call(components.store.get_key, request.path_params["key_id"])
    return _json(key.to_json())


async def revoke_key(request: Request) -> Response:
    components = await _admin(request)
    key_id = request.path_params["key_id"]
    key = await _call(components.store.revoke_key, key_id)
    await components.revocations.key_revoked(key_id)
    return _json(key.to_json())


async def _admin(request: Request) -> Any:
    components = request.app.state.components
    await components.authenticator.require_admin(request.headers.get("authorization"))
    return components


async def _call(function: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(function, *args)
    except StoreNotFound as exc:
        raise not_found(str(exc)) from exc
    except SQLAlchemyError as exc:
        raise unavailable(
            "The tenant store is unavailable; try again.", code="store_unavailable"
        ) from exc


async def _json_object(request: Request, *, allowed: set[str]) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    unknown = set(body) - allowed
    if unknown:
        field = sorted(unknown)[0]
        raise bad_request(f"Unknown field {quoted(field)}.", param=field)
    return body


def _optional_name(body: dict[str, Any]) -> str | None:
    name = body.get("name")
    if name is None:
        return None
    if not isinstance(name, str) or len(name) > _MAX_NAME_CHARS:
        raise bad_request(
            f"'name' must be a string of at most {_MAX_NAME_CHARS} characters.", param="name"
        )
    return name


def _conflict(message: str, param: str) -> APIError:
    return APIError(409, message, "invalid_request_error", "conflict", param)


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")
