"""The gateway's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Request bodies of the generation routes are generated from the pydantic models in
``gateway.protocol`` (the same models that validate requests), so the document cannot drift
from what the gateway accepts. Everything else is written out here, next to the handlers'
docstrings it mirrors (``admin_api``, ``audit_api``). Every failure response is the one
OpenAI error shape of ``gateway.errors``.

Schema-driven fuzzing (``tests/security``) reads this document, so a route missing here is a
route nobody fuzzes: keep it complete.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import orjson
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from .protocol import ChatCompletionRequest, CompletionRequest
from .store import OUTCOMES

_REF = "#/components/schemas/{model}"
_ERROR = {"$ref": "#/components/schemas/Error"}
_BEARER = [{"bearer": []}]


def _version() -> str:
    try:
        return metadata.version("isogate")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0.0.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    descriptions = {
        400: "Invalid request (OpenAI error format).",
        401: "Missing, malformed, unknown or revoked API key.",
        403: "The key may not use this endpoint (admin key on a generation route, tenant key on /admin, "
        "another tenant named, tenant disabled).",
        404: "No such model, tenant, key or audit event.",
        405: "Method not allowed.",
        409: "Already exists.",
        413: "Request body too large.",
        429: "Rate limit exceeded.",
        502: "A worker failed, or an isolation check failed on its answer.",
        503: "No worker, store or key store available now.",
        504: "A worker did not answer in time.",
    }
    return {
        str(status): {"description": descriptions[status], "content": _json_content(_ERROR)}
        for status in statuses
    }


_AUTHENTICATED = (401, 403)
_GENERATION_ERRORS = _errors(400, *_AUTHENTICATED, 404, 413, 429, 502, 503, 504)


def _request_schemas() -> dict[str, Any]:
    _, generated = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template=_REF,
    )
    return generated["$defs"]


def _response_schemas() -> dict[str, Any]:
    nullable_int = {"type": ["integer", "null"]}
    nullable_str = {"type": ["string", "null"]}
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {"type": "integer"}},
            },
        },
    }
    finish_reason = {"type": ["string", "null"], "enum": ["stop", "length", None]}
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "additionalProperties": False,
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "additionalProperties": False,
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "type": {"type": "string", "minLength": 1},
                        "param": nullable_str,
                        "code": nullable_str,
                    },
                }
            },
        },
        "Usage": usage,
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "chat.completion"},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "message", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer"},
                            "message": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"const": "assistant"},
                                    "content": {"type": "string"},
                                },
                            },
                            "logprobs": {"type": "null"},
                            "finish_reason": finish_reason,
                        },
                    },
                },
                "usage": _ref("Usage"),
            },
        },
        "Completion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "text_completion"},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "text", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer"},
                            "text": {"type": "string"},
                            "logprobs": {"type": "null"},
                            "finish_reason": finish_reason,
                        },
                    },
                },
                "usage": _ref("Usage"),
            },
        },
        "Model": {
            "type": "object",
            "required": ["id", "object", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "max_context_tokens": nullable_int,
                "max_context_bound": nullable_str,
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("Model")},
            },
        },
        "AuditEvent": {
            "type": "object",
            "required": [
                "object",
                "id",
                "generation_id",
                "tenant",
                "outcome",
                "status",
                "created_at",
            ],
            "properties": {
                "object": {"const": "audit.event"},
                "id": {"type": "string"},
                "generation_id": {"type": "string"},
                "tenant": {"type": "string"},
                "key_id": nullable_str,
                "model": nullable_str,
                "outcome": {"type": "string", "enum": list(OUTCOMES)},
                "status": {"type": "integer"},
                "code": nullable_str,
                "prefill_worker": nullable_str,
                "decode_worker": nullable_str,
                "prompt_tokens": nullable_int,
                "completion_tokens": nullable_int,
                "stream": {"type": "boolean"},
                "latency_ms": {"type": ["number", "null"]},
                "created_at": {"type": "string", "format": "date-time"},
                "detail": nullable_str,
            },
        },
        "AuditEventList": {
            "type": "object",
            "required": ["object", "data", "next_cursor"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("AuditEvent")},
                "next_cursor": nullable_str,
            },
        },
        "Tenant": {
            "type": "object",
            "required": ["object", "id", "disabled", "created_at"],
            "properties": {
                "object": {"const": "tenant"},
                "id": {"type": "string"},
                "name": nullable_str,
                "disabled": {"type": "boolean"},
                "created_at": {"type": "string", "format": "date-time"},
            },
        },
        "TenantList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("Tenant")},
            },
        },
        "ApiKey": {
            "type": "object",
            "required": ["object", "id", "tenant", "created_at", "revoked_at"],
            "properties": {
                "object": {"const": "api_key"},
                "id": {"type": "string"},
                "tenant": {"type": "string"},
                "name": nullable_str,
                "created_at": {"type": "string", "format": "date-time"},
                "revoked_at": {"type": ["string", "null"], "format": "date-time"},
                "key": {
                    "type": "string",
                    "description": "The raw key; only in the answer that created it.",
                },
            },
        },
        "ApiKeyList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("ApiKey")},
            },
        },
        "Worker": {
            "type": "object",
            "required": ["url", "role", "fresh", "capacity", "claimed_tokens", "error"],
            "properties": {
                "url": {"type": "string"},
                "role": {"type": "string", "enum": ["prefill", "decode"]},
                "fresh": {"type": "boolean"},
                "capacity": {"type": ["object", "null"]},
                "claimed_tokens": {"type": "integer", "minimum": 0},
                "error": nullable_str,
            },
        },
        "WorkerList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("Worker")},
            },
        },
        "TenantCreate": {
            "type": "object",
            "required": ["id"],
            "additionalProperties": False,
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$"},
                "name": {"type": ["string", "null"], "maxLength": 200},
            },
        },
        "KeyCreate": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"name": {"type": ["string", "null"], "maxLength": 200}},
        },
    }


def _generation(summary: str, body: str, result: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "requestBody": {"required": True, "content": _json_content(_ref(body))},
            "responses": {
                "200": {
                    "description": f'A {result}, or with "stream": true an SSE stream of chunks ending in '
                    '"data: [DONE]" (a failure after the first byte ends the stream with one '
                    "error event and no [DONE]).",
                    "content": {
                        **_json_content(_ref(result)),
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                **_GENERATION_ERRORS,
            },
        }
    }


# One server-sent event: "data" carries a JSON chunk (or an error object, or "[DONE]").
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
    },
}


def _path_param(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1},
    }


def _query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


def _admin(
    method: str,
    summary: str,
    ok: str,
    result: str,
    *,
    params: list[dict[str, Any]] | None = None,
    body: str | None = None,
    errors: tuple[int, ...] = (),
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "security": _BEARER,
        "responses": {
            ok: {"description": "OK", "content": _json_content(_ref(result))},
            **_errors(*_AUTHENTICATED, *errors, 503),
        },
    }
    if params:
        operation["parameters"] = params
    if body:
        operation["requestBody"] = {"required": False, "content": _json_content(_ref(body))}
    return {method: operation}


def _paths() -> dict[str, Any]:
    tenant_id, key_id = _path_param("tenant_id"), _path_param("key_id")
    audit_filters = [
        _query_param(
            "tenant", {"type": "string"}, "A tenant key may name only its own tenant (else 403)."
        ),
        _query_param(
            "since",
            {"type": "string", "format": "date-time"},
            "Inclusive, RFC 3339 with an offset.",
        ),
        _query_param(
            "until",
            {"type": "string", "format": "date-time"},
            "Exclusive, RFC 3339 with an offset.",
        ),
        _query_param(
            "outcome", {"type": "string", "enum": list(OUTCOMES)}, "Only events with this outcome."
        ),
        _query_param("model", {"type": "string"}, "Only events of this model."),
        _query_param("generation_id", {"type": "string"}, "The id a response carried."),
        _query_param(
            "limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "Page size (default 100)."
        ),
        _query_param("cursor", {"type": "string"}, "next_cursor of the previous page."),
    ]
    return {
        "/v1/chat/completions": _generation(
            "Create a chat completion", "ChatCompletionRequest", "ChatCompletion"
        ),
        "/v1/completions": _generation("Create a completion", "CompletionRequest", "Completion"),
        "/v1/models": {
            "get": {
                "summary": "Models, with their effective context as of now",
                "security": _BEARER,
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("ModelList"))},
                    **_errors(*_AUTHENTICATED, 503),
                },
            }
        },
        "/v1/audit/events": {
            "get": {
                "summary": "Audit events, newest first (a tenant key sees only its own tenant's)",
                "security": _BEARER,
                "parameters": audit_filters,
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("AuditEventList"))},
                    **_errors(400, *_AUTHENTICATED, 503),
                },
            }
        },
        "/v1/audit/events/{generation_id}": {
            "get": {
                "summary": "One audit event (404 when it belongs to another tenant)",
                "security": _BEARER,
                "parameters": [_path_param("generation_id")],
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("AuditEvent"))},
                    **_errors(*_AUTHENTICATED, 404, 503),
                },
            }
        },
        "/admin/tenants": {
            **_admin(
                "post", "Create a tenant", "201", "Tenant", body="TenantCreate", errors=(400, 409)
            ),
            **_admin("get", "List tenants", "200", "TenantList"),
        },
        "/admin/tenants/{tenant_id}": _admin(
            "get", "A tenant", "200", "Tenant", params=[tenant_id], errors=(404,)
        ),
        "/admin/tenants/{tenant_id}/disable": _admin(
            "post", "Disable a tenant", "200", "Tenant", params=[tenant_id], errors=(404,)
        ),
        "/admin/tenants/{tenant_id}/enable": _admin(
            "post", "Enable a tenant", "200", "Tenant", params=[tenant_id], errors=(404,)
        ),
        "/admin/tenants/{tenant_id}/keys": {
            **_admin(
                "post",
                "Create a key (the raw key is in this answer only)",
                "201",
                "ApiKey",
                params=[tenant_id],
                body="KeyCreate",
                errors=(400, 404),
            ),
            **_admin(
                "get", "A tenant's keys", "200", "ApiKeyList", params=[tenant_id], errors=(404,)
            ),
        },
        "/admin/keys": _admin(
            "get",
            "List keys",
            "200",
            "ApiKeyList",
            errors=(400,),
            params=[_query_param("tenant", {"type": "string"}, "Only this tenant's keys.")],
        ),
        "/admin/keys/{key_id}": {
            **_admin("get", "A key", "200", "ApiKey", params=[key_id], errors=(404,)),
            **_admin("delete", "Revoke a key", "200", "ApiKey", params=[key_id], errors=(404,)),
        },
        "/admin/keys/{key_id}/revoke": _admin(
            "post", "Revoke a key", "200", "ApiKey", params=[key_id], errors=(404,)
        ),
        "/admin/workers": _admin(
            "get",
            "The capacity view this replica decides on, one record per worker",
            "200",
            "WorkerList",
        ),
        "/healthz": {
            "get": {"summary": "Liveness", "responses": {"200": {"description": "Alive"}}}
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: every model has a prefill and a decode worker answering",
                "responses": {"200": {"description": "Ready"}, "503": {"description": "Not ready"}},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (admin key: the series name tenants)",
                "security": _BEARER,
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(*_AUTHENTICATED, 503),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": _json_content({"type": "object"}),
                    }
                },
            }
        },
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "isogate",
            "version": _version(),
            "description": "OpenAI-compatible, multi-tenant gateway in front of SGLang prefill/decode "
            "clusters that checks tenant isolation end to end.",
        },
        "paths": _paths(),
        "components": {
            "schemas": {**_request_schemas(), **_response_schemas()},
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A tenant key (sk-iso-...) or the admin key.",
                }
            },
        },
    }


async def openapi_json(request: Request) -> Response:
    return Response(_document_bytes(), media_type="application/json")


@functools.cache
def _document_bytes() -> bytes:
    return orjson.dumps(openapi_document())
