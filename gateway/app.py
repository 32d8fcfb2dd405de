"""The Starlette application: routes, error rendering, and the components' lifetime."""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from .admin_api import admin_routes
from .api import openai_routes
from .audit_api import audit_routes
from .components import build_components, close_components
from .errors import APIError
from .reload import PolicyReloader
from .settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.components = await build_components(settings)
        # Policy changes take effect without a restart: file watch and SIGHUP (gateway.reload).
        reloader = PolicyReloader(app.state.components)
        reloader.start()
        try:
            yield
        finally:
            await reloader.stop()
            await close_components(app.state.components)

    return Starlette(
        routes=[*openai_routes(), *audit_routes(), *admin_routes()],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
        lifespan=lifespan,
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
    return APIError(exc.status_code, str(exc.detail), "invalid_request_error", kind).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # Never a stack trace to the client; the log has it.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "Internal error.", "server_error", "internal_error").response()
