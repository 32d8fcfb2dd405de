"""The gateway's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Every schema in it is generated from a pydantic model, so the document cannot drift from what
the gateway accepts or sends: request bodies from the models that validate them
(``gateway.openai.protocol``; the admin bodies below mirror ``admin_routes``'s checks), answers from
models that describe exactly the dicts the gateway builds (``gateway.openai.protocol``'s response
models, the admin and audit models below). Those answers are built as plain dicts, never
through the models; tests validate each builder's and each route's real output with its model,
strictly, and with this document (``tests/unit/api/test_openapi_models.py``,
``tests/tenancy/test_answer_schemas.py``). The paths are written out here, next to the
handlers' docstrings they mirror (``admin_routes``, ``audit_routes``). Every failure response is the
one OpenAI error shape of ``gateway.common.errors`` (``ErrorResponse``).

Schema-driven fuzzing (``tests/security``) reads this document, so a route missing here is a
route nobody fuzzes: keep it complete.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.admin_routes import _MAX_NAME_CHARS, TENANT_ID_PATTERN
from gateway.api.tokenize_routes import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.api.unsupported import SERVED, UNSUPPORTED_ENDPOINTS
from gateway.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageChunk,
)
from gateway.openai.responses import (
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from gateway.tenancy.store import OUTCOMES
from gateway.workers.capacity import Role

_REF = "#/components/schemas/{model}"
_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}]


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
        403: "The key may not use this endpoint (admin key on a generation route, tenant key on "
        "/admin, another tenant named, tenant disabled).",
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


# ---- the admin and audit routes' bodies ------------------------------------------------
#
# What ``admin_routes``, ``audit_routes`` and ``openai_routes.workers`` send and accept, as
# models: not the
# OpenAI wire format (that is ``gateway.openai.protocol``), so they are here, beside the routes'
# description. Like protocol's response models they are never built on a request's path;
# tests validate each route's real answers with them (strict, no field missing or extra).


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Tenant(_Body):
    object: Literal["tenant"]
    id: str
    name: str
    disabled: bool
    created_at: AwareDatetime


class TenantList(_Body):
    object: Literal["list"]
    data: list[Tenant]


class ApiKey(_Body):
    object: Literal["api_key"]
    id: str
    tenant: str
    name: str
    created_at: AwareDatetime
    revoked_at: AwareDatetime | None
    # The only models the key may call, within its tenant's; null: its tenant's.
    models: list[str] | None


class ApiKeyCreated(ApiKey):
    """The answer that created a key: the only one that carries the raw key."""

    key: str = Field(description="The raw key; only in the answer that created it.")


class ApiKeyList(_Body):
    object: Literal["list"]
    data: list[ApiKey]


def _known_outcome(outcome: str) -> str:
    if outcome not in OUTCOMES:
        raise ValueError(f"not an outcome: {outcome!r}")
    return outcome


# The outcomes are gateway.tenancy.store's tuple; an enum of the schema, not a second list.
AuditOutcome = Annotated[
    str,
    AfterValidator(_known_outcome),
    WithJsonSchema({"type": "string", "enum": list(OUTCOMES)}),
]


class AuditEvent(_Body):
    """One request's audit record."""

    object: Literal["audit.event"]
    id: str
    generation_id: str
    tenant: str
    key_id: str | None
    model: str | None
    outcome: AuditOutcome
    status: int
    code: str | None
    prefill_worker: str | None  # null for a tenant key: worker URLs are the operators'
    decode_worker: str | None
    pool: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    stream: bool
    latency_ms: float  # never null: the column is NOT NULL
    created_at: AwareDatetime
    detail: str | None
    policy_model: str | None  # the model ``model`` (an alias) named; null before it was found


class AuditEventList(_Body):
    object: Literal["list"]
    data: list[AuditEvent]
    next_cursor: str | None


class WorkerCapacity(_Body):
    """The capacity record of a worker, as last polled (``workers.capacity.WorkerCapacity``)."""

    url: str
    role: Role
    observed_at: float
    max_total_num_tokens: int
    max_req_input_len: int | None
    context_length: int | None
    page_size: int
    used_tokens: int
    engine_patch: str | None
    max_running_requests: int | None
    waiting_requests: int
    # Each stream chunk carries only what it adds (``--incremental-streaming-output``).
    incremental_streams: bool


class Worker(_Body):
    url: str
    role: Role
    fresh: bool  # routed to: a capacity record to route on, and not taken out as dead
    capacity_fresh: bool  # the capacity signal: its last poll is recent
    alive: bool  # the liveness signal: it answered /health (or a poll) recently
    capacity: WorkerCapacity | None
    claimed_tokens: int = Field(ge=0)
    error: str | None  # why its capacity poll failed
    liveness_error: str | None  # why its liveness probe failed


class WorkerList(_Body):
    object: Literal["list"]
    data: list[Worker]


class PolicySummary(_Body):
    """The policies in force (``Policies.summary``): models with their bounds, limits and
    pools, aliases, and each tenant's policy as tenants.yaml gives it."""

    models: dict[str, dict[str, Any]]
    aliases: dict[str, str]
    tenant_defaults: dict[str, Any]
    tenants: dict[str, dict[str, Any]]


class TenantCreate(_Body):
    id: str = Field(pattern=TENANT_ID_PATTERN.pattern)
    name: str | None = Field(default=None, max_length=_MAX_NAME_CHARS)


class KeyCreate(_Body):
    name: str | None = Field(default=None, max_length=_MAX_NAME_CHARS)
    models: list[str] | None = Field(
        default=None,
        description="The only models the key may call (names in models.yaml), within its "
        "tenant's; fixed for the key's life. Absent: its tenant's.",
    )


# Request bodies are described as they are validated, answers as they are sent.
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    TokenizeRequest,
    DetokenizeRequest,
    TenantCreate,
    KeyCreate,
)
_RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse,
    ResponseObject,
    ResponseItemList,
    ResponseDeleted,
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    UsageChunk,
    ModelList,
    ModelCard,
    TokenizeResponse,
    DetokenizeResponse,
    AuditEventList,
    AuditEvent,
    Tenant,
    TenantList,
    ApiKey,
    ApiKeyCreated,
    ApiKeyList,
    WorkerList,
    PolicySummary,
)


def _schemas() -> dict[str, Any]:
    """Every component schema, generated from the models in one pass (so each model has one
    name, and the models they nest are components too)."""
    _, generated = models_json_schema(
        [(model, "validation") for model in _REQUEST_MODELS]
        + [(model, "serialization") for model in _RESPONSE_MODELS],
        ref_template=_REF,
    )
    schemas: dict[str, Any] = generated["$defs"]
    return schemas


def _generation(summary: str, body: str, result: str, chunk: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "requestBody": {"required": True, "content": _json_content(_ref(body))},
            "responses": {
                "200": {
                    "description": f'A {result}, or with "stream": true an SSE stream of '
                    f"{chunk} events (then a UsageChunk with stream_options.include_usage) "
                    'ending in "data: [DONE]" (a failure after the first byte ends the stream '
                    "with one ErrorResponse event and no [DONE]).",
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


def _tenant_post(summary: str, body: str, result: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "requestBody": {"required": True, "content": _json_content(_ref(body))},
            "responses": {
                "200": {"description": "OK", "content": _json_content(_ref(result))},
                **_errors(400, *_AUTHENTICATED, 404, 413, 503),
            },
        }
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


def _responses_paths() -> dict[str, Any]:
    """The Responses API (``gateway.api.responses_api``): created through the generation
    pipeline; stored responses read and deleted by the tenant that created them only (another
    tenant's id is the same 404 as a missing one)."""
    response_id = _path_param("response_id")
    stored_errors = _errors(*_AUTHENTICATED, 404, 429, 503)
    return {
        "/v1/responses": {
            "post": {
                "summary": "Create a response (the Responses API), on the same core as chat",
                "security": _BEARER,
                "requestBody": {
                    "required": True,
                    "content": _json_content(_ref("ResponsesRequest")),
                },
                "responses": {
                    "200": {
                        "description": 'A ResponseObject, or with "stream": true an SSE stream of '
                        "the Responses API's semantic events (response.created ... "
                        "response.completed or response.incomplete; a failure after the first "
                        "byte ends it with an error event and response.failed).",
                        "content": {
                            **_json_content(_ref("ResponseObject")),
                            "text/event-stream": {"schema": _SSE_EVENT},
                        },
                    },
                    **_GENERATION_ERRORS,
                },
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A stored response, as it was answered",
                "security": _BEARER,
                "parameters": [response_id],
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("ResponseObject"))},
                    **stored_errors,
                },
            },
            "delete": {
                "summary": "Delete a stored response",
                "security": _BEARER,
                "parameters": [response_id],
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("ResponseDeleted"))},
                    **stored_errors,
                },
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "A stored response's input items, a page at a time",
                "security": _BEARER,
                "parameters": [
                    response_id,
                    _query_param("after", {"type": "string"}, "The item id the page starts after."),
                    _query_param(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": 100},
                        "Page size (default 20).",
                    ),
                    _query_param(
                        "order", {"type": "string", "enum": ["asc", "desc"]}, "Default desc."
                    ),
                ],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": _json_content(_ref("ResponseItemList")),
                    },
                    **_errors(400, *_AUTHENTICATED, 404, 503),
                },
            }
        },
    }


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
            "Create a chat completion",
            "ChatCompletionRequest",
            "ChatCompletion",
            "ChatCompletionChunk",
        ),
        "/v1/completions": _generation(
            "Create a completion", "CompletionRequest", "Completion", "CompletionChunk"
        ),
        **_responses_paths(),
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
        "/v1/models/{model}": {
            "get": {
                "summary": "One model's card, as /v1/models lists it",
                "security": _BEARER,
                "parameters": [_path_param("model")],
                "responses": {
                    "200": {"description": "OK", "content": _json_content(_ref("ModelCard"))},
                    **_errors(*_AUTHENTICATED, 404, 503),
                },
            }
        },
        "/v1/tokenize": _tenant_post(
            "Tokenize with the model's own tokenizer (SGLang's body), with this tenant's prompt "
            "limit as of now and whether the prompt fits",
            "TokenizeRequest",
            "TokenizeResponse",
        ),
        "/v1/detokenize": _tenant_post(
            "Token ids back to text with the model's own tokenizer (SGLang's body)",
            "DetokenizeRequest",
            "DetokenizeResponse",
        ),
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
                "ApiKeyCreated",
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
        "/admin/policies": _admin(
            "get",
            "The policies in force on this replica (what `isogate policies check --live` reads)",
            "200",
            "PolicySummary",
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
        "/health": {
            "get": {
                "summary": "SGLang's and SMG's name for readiness: 200 when the gateway can serve, "
                "as /readyz",
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


def _unsupported_paths() -> dict[str, Any]:
    """OpenAI's endpoints not served here (``gateway.api.unsupported``): each answers 404
    ``unsupported_endpoint`` naming it, to any method, at its path and every path below."""
    return {
        path: {
            "post": {
                "summary": f"Not served: OpenAI's {name} (any method, any path below it)",
                "responses": {
                    "404": {
                        "description": f"unsupported_endpoint: this gateway serves {SERVED}.",
                        "content": _json_content(_ERROR),
                    }
                },
            }
        }
        for path, name in UNSUPPORTED_ENDPOINTS.items()
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "isogate",
            "version": _version(),
            "description": "OpenAI-compatible, multi-tenant gateway in front of SGLang "
            "prefill/decode clusters that checks tenant isolation end to end.",
        },
        "paths": {**_paths(), **_unsupported_paths()},
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A tenant key (sk-iso-...) or the admin key.",
                }
            },
        },
    }


def openapi_endpoint() -> Callable[[Request], Awaitable[Response]]:
    """The handler of ``GET /openapi.json``, with the document built now, as the app is built:
    building it takes tens of milliseconds, which at the first request would hold the event
    loop, and every request on it, that long."""
    document = orjson.dumps(openapi_document())

    async def openapi_json(request: Request) -> Response:
        return Response(document, media_type="application/json")

    return openapi_json
