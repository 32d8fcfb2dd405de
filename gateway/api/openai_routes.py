"""The OpenAI-compatible routes and the health endpoints.

Handlers are thin: generation routes hand over to ``gateway.api.pipeline``, tokenize and detokenize
to ``gateway.api.tokenize_routes``; the rest read state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.api import responses_api, tokenize_routes
from gateway.api.answers import Kind
from gateway.api.openapi import openapi_endpoint
from gateway.api.pipeline import handle_generation
from gateway.api.unsupported import unsupported_routes
from gateway.common.errors import APIError
from gateway.config.policies import ModelPolicy
from gateway.openai import protocol
from gateway.service.components import Components
from gateway.tenancy.auth import Principal


def _components(request: Request) -> Components:
    components: Components = request.app.state.components
    return components


def _json(payload: object, status: int = 200) -> Response:
    return _json_bytes(orjson.dumps(payload), status)


def _json_bytes(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type="application/json")


# The generation routes (POST). ``gateway.api.app.Gateway`` sends these paths straight to the
# pipeline; the Starlette routes below serve the same handlers for anything it passes on.
GENERATION_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
}


async def chat_completions(request: Request) -> Response:
    return await handle_generation(_components(request), request.scope, request.receive, "chat")


async def completions(request: Request) -> Response:
    return await handle_generation(
        _components(request), request.scope, request.receive, "completion"
    )


async def responses(request: Request) -> Response:
    return await handle_generation(
        _components(request), request.scope, request.receive, "responses"
    )


async def models(request: Request) -> Response:
    components = _components(request)
    principal = await components.authenticator.authenticate(request.headers.get("authorization"))
    policies = components.policies
    tenant = None if principal.is_admin else principal.tenant_id
    names = policies.public_names(tenant, principal.models)
    cards = [_card(components, principal, m, name) for name, m in names]
    return _json(protocol.model_list(cards))


async def retrieve_model(request: Request) -> Response:
    """One model's card, as ``/v1/models`` lists it; 404 ``model_not_found`` as OpenAI's."""
    components = _components(request)
    principal = await components.authenticator.authenticate(request.headers.get("authorization"))
    name, policies = request.path_params["model"], components.policies
    # The admin sees every model; a tenant what it may call, as the generation routes find it.
    found = policies.resolve_model(
        None if principal.is_admin else principal.tenant_id, name, principal.models
    )
    return _json(_card(components, principal, found, name))


def _card(
    components: Components, principal: Principal, model: ModelPolicy, name: str
) -> dict[str, Any]:
    """The card of a model under the name it is called by (its own or an alias)."""
    max_context: int | None = None
    bound: str | None = None
    try:
        tenant = principal.tenant_id if not principal.is_admin else ""
        candidates = components.routes.candidates(components.policies, model, tenant)
        # The largest prompt admitted with a minimal completion, plus that completion.
        limit = candidates.best_limit(1, components.settings.admission_safety_margin_tokens)
        max_context, bound = limit.tokens + 1, limit.bound
    except APIError:
        pass  # no fresh pair now: the card says so with nulls rather than guessing
    return protocol.model_card(name, 0, max_context, bound)


async def tokenize(request: Request) -> Response:
    """SGLang's ``/v1/tokenize``, plus this tenant's admission limit now; metered and bounded
    as a tenant's request (``tokenize_routes``)."""
    return await tokenize_routes.serve(
        _components(request), request.scope, request.receive, "tokenize"
    )


async def detokenize(request: Request) -> Response:
    """SGLang's ``/v1/detokenize``: token ids back to text; 400 for an id outside the vocabulary;
    metered and bounded as a tenant's request (``tokenize_routes``)."""
    return await tokenize_routes.serve(
        _components(request), request.scope, request.receive, "detokenize"
    )


async def workers(request: Request) -> Response:
    """The capacity view this replica decides on (admin only): one record per worker, with its
    two signals, capacity (``capacity_fresh``, ``error``) and liveness (``alive``,
    ``liveness_error``), and whether it is routed to (``fresh``: a record to route on)."""
    components = _components(request)
    await components.authenticator.require_admin(request.headers.get("authorization"))
    capacity = components.capacity
    data = []
    for url, role in components.workers():
        state = capacity.get(url)
        data.append(
            {
                "url": url,
                "role": role,
                "fresh": state is not None,
                "capacity_fresh": capacity.fresh(url),
                "alive": capacity.alive(url),
                "capacity": state.as_dict() if state else None,
                "claimed_tokens": components.ledger.claimed.get(url, 0),
                "error": capacity.error(url),
                "liveness_error": capacity.liveness_error(url),
            }
        )
    return _json({"object": "list", "data": data})


async def policies(request: Request) -> Response:
    """The policies in force on this replica (admin only), as ``Policies.summary`` gives them:
    what ``isogate policies check --live`` compares a directory with."""
    components = _components(request)
    await components.authenticator.require_admin(request.headers.get("authorization"))
    return _json(components.policies.summary())


async def healthz(request: Request) -> Response:
    return _json({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when every model has at least one prefill and one decode worker answering."""
    return _readiness(_components(request))


async def health(request: Request) -> Response:
    """``/health`` as SGLang's workers and SMG name it: 200 when the gateway can serve, 503 when
    not (SGLang's answers are bodiless; this one says why, as ``/readyz`` does). Callers that
    probe ``/health`` (SMG, SGLang tooling, load balancers) get readiness, not mere liveness:
    a gateway with no worker answering cannot serve a request."""
    return _readiness(_components(request))


def _readiness(components: Components) -> Response:
    problems: dict[str, list[str]] = {}
    for model in components.policies.models.values():
        for role, urls in (
            ("prefill", [w.url for p in model.pools for w in p.prefill]),
            ("decode", [w.url for p in model.pools for w in p.decode]),
        ):
            if not any(components.capacity.get(url) for url in urls):
                problems.setdefault(model.name, []).append(f"no {role} worker answering")
    if problems:
        return _json({"status": "unready", "problems": problems}, 503)
    return _json({"status": "ready"})


async def metrics(request: Request) -> Response:
    """Prometheus metrics, admin key only: the series name tenants and their traffic."""
    components = _components(request)
    await components.authenticator.require_admin(request.headers.get("authorization"))
    body = await asyncio.to_thread(components.metrics_exposition)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def openai_routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        *responses_api.responses_routes(),
        Route("/v1/models", models, methods=["GET"]),
        # A model name may contain "/" (``org/name``), as Hugging Face ids do.
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/admin/workers", workers, methods=["GET"]),
        Route("/admin/policies", policies, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint(), methods=["GET"]),
        # OpenAI's endpoints not served here: a 404 that names each (``unsupported``).
        *unsupported_routes(),
    ]
