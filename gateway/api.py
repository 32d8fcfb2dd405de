"""The OpenAI-compatible routes and the health endpoints.

Handlers are thin: generation routes hand over to ``gateway.pipeline``; the rest read state.
"""

from __future__ import annotations

import asyncio

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from . import protocol
from .components import Components
from .errors import APIError
from .openapi import openapi_json
from .pipeline import Kind, handle_generation


def _components(request: Request) -> Components:
    components: Components = request.app.state.components
    return components


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


# The generation routes (POST). ``gateway.app.Gateway`` sends these paths straight to the
# pipeline; the Starlette routes below serve the same handlers for anything it passes on.
GENERATION_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
}


async def chat_completions(request: Request) -> Response:
    return await handle_generation(_components(request), request, "chat")


async def completions(request: Request) -> Response:
    return await handle_generation(_components(request), request, "completion")


async def models(request: Request) -> Response:
    components = _components(request)
    principal = await components.authenticator.authenticate(request.headers.get("authorization"))
    cards = []
    margin = components.settings.admission_safety_margin_tokens
    for model in components.policies.models.values():
        max_context: int | None = None
        bound: str | None = None
        try:
            tenant = principal.tenant_id if not principal.is_admin else ""
            candidates = components.routes.candidates(components.policies, model, tenant)
            # The largest prompt admitted with a minimal completion, plus that completion.
            limit = candidates.best_limit(1, margin)
            max_context, bound = limit.tokens + 1, limit.bound
        except APIError:
            pass  # no fresh pair now: the card says so with nulls rather than guessing
        cards.append(protocol.model_card(model.name, 0, max_context, bound))
    return _json(protocol.model_list(cards))


async def workers(request: Request) -> Response:
    """The capacity view this replica decides on (admin only): one record per worker."""
    components = _components(request)
    await components.authenticator.require_admin(request.headers.get("authorization"))
    data = []
    for url, role in components.workers():
        state = components.capacity.get(url)
        data.append(
            {
                "url": url,
                "role": role,
                "fresh": state is not None,
                "capacity": state.as_dict() if state else None,
                "claimed_tokens": components.ledger.claimed.get(url, 0),
                "error": components.capacity.error(url),
            }
        )
    return _json({"object": "list", "data": data})


async def healthz(request: Request) -> Response:
    return _json({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when every model has at least one prefill and one decode worker answering."""
    components = _components(request)
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
    workers: list[tuple[str, str]] = list(components.workers())
    body = await asyncio.to_thread(components.metrics.export, components.capacity, workers)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def openai_routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/admin/workers", workers, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
