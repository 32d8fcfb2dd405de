"""The ASGI application: routes, error rendering, and the components' lifetime."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.admin_routes import admin_routes
from gateway.api.audit_routes import audit_routes
from gateway.api.openai_routes import GENERATION_PATHS, openai_routes
from gateway.api.pipeline import handle_generation
from gateway.common.errors import APIError
from gateway.common.ids import PREFIX as GENERATION_PREFIX
from gateway.common.ids import new_generation_id
from gateway.config.settings import Settings
from gateway.server.http_server import HEADER_LINES_EXTENSION
from gateway.service.components import build_components, close_components
from gateway.service.reload import PolicyReloader

log = logging.getLogger(__name__)

# A request that is not a generation is answered with an ID of its own: a generation ID's
# form under this prefix (it names no audit event).
REQUEST_ID_PREFIX = "req_"


def create_app(settings: Settings | None = None) -> Gateway:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.components = await build_components(settings)
        _freeze_startup_heap()
        # Policy changes take effect without a restart: file watch and SIGHUP (service.reload).
        reloader = PolicyReloader(app.state.components)
        reloader.start()
        try:
            yield
        finally:
            await reloader.stop()
            await close_components(app.state.components)

    app = Starlette(
        routes=[*openai_routes(), *audit_routes(), *admin_routes()],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
        lifespan=lifespan,
    )
    # Starlette's own trailing-slash redirect writes an absolute URL built from the client's
    # Host header into Location; this one writes the path alone.
    app.router.redirect_slashes = False
    app.router.default = _slash_redirect(app.router)
    return Gateway(app)


class Gateway:
    """The ASGI app: generation requests go straight to the pipeline, the rest through Starlette.

    Why: on the hot path Starlette's two middlewares, its router and its per-route exception
    wrapper cost as much CPU as the pipeline's own steps, and add nothing there:
    ``handle_generation`` already answers every failure as an OpenAI error, audited. Any
    request this does not recognise (another method, a trailing slash, a root path) takes
    Starlette's route to the same handlers, so the two paths cannot disagree on behaviour.
    """

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = GENERATION_PATHS.get(scope["path"])
            if kind is not None:
                response = await handle_generation(self.state.components, scope, receive, kind)
                await response(scope, receive, send)
                return
        if scope["type"] == "http":
            send = _with_request_id(send)
        await self.app(scope, receive, send)


def _with_request_id(send: Send) -> Send:
    """``send``, adding an ``x-request-id`` to a response that has none: a fresh ID for each
    request that is not a generation (a generation's answer carries its generation ID)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers") or ())
            lines = message.get(HEADER_LINES_EXTENSION) or b""
            if b"x-request-id: " not in lines and not any(
                name.lower() == b"x-request-id" for name, _ in headers
            ):
                request_id = REQUEST_ID_PREFIX + new_generation_id()[len(GENERATION_PREFIX) :]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
        await send(message)

    return sending


def _slash_redirect(router: Router) -> ASGIApp:
    """What a path no route matches gets: a 307 to the same path with its trailing slash added
    or removed, where that one matches a route (as Starlette's redirect_slashes), with a
    relative Location that echoes nothing of the request but its path; otherwise the 404."""

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if scope["type"] == "http" and path != "/":
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            redirected = {**scope, "path": other}
            # "//host" would be a reference to another host: never a Location of ours.
            if not other.startswith("//") and any(
                route.matches(redirected)[0] is not Match.NONE for route in router.routes
            ):
                raw = scope.get("raw_path")
                location = (
                    (raw.rstrip(b"/") if raw.endswith(b"/") else raw + b"/").decode("latin-1")
                    if isinstance(raw, bytes) and raw
                    else other
                )
                query = scope.get("query_string", b"").decode("latin-1")
                if query:
                    location += "?" + query
                if not location.startswith(("//", "/\\")):
                    await RedirectResponse(location, status_code=307)(scope, receive, send)
                    return
        await router.not_found(scope, receive, send)

    return default


def _freeze_startup_heap() -> None:
    """Move what startup built (tokenizers, templates, policies, SQLAlchemy, ~70k objects) out of
    the collector's sight: it lives as long as the process, and a full collection walking it took
    ~40 ms, which was the p99 of a loaded gateway. Collections then walk request garbage only."""
    gc.collect()
    gc.freeze()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = (
        "not_found"
        if exc.status_code == 404
        else "method_not_allowed"
        if exc.status_code == 405
        else "http_error"
    )
    return APIError(exc.status_code, str(exc.detail), "invalid_request_error", kind).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # Never a stack trace to the client; the log has it.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "Internal error.", "server_error", "internal_error").response()
