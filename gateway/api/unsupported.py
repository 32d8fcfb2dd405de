"""OpenAI's endpoints that this gateway does not serve, answered as such.

A client pointed at the gateway for embeddings, files or images would otherwise get the generic
404 ``not_found``, which SDKs and their users read as a wrong base URL. Each family here gets
an OpenAI-format 404 ``unsupported_endpoint`` that names it, under its path and every path
below it, whatever the method; ``gateway.api.openapi`` documents them.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.common.errors import APIError

# Each family's path and the name an error gives it.
UNSUPPORTED_ENDPOINTS: dict[str, str] = {
    "/v1/embeddings": "embeddings",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/uploads": "uploads",
    "/v1/batches": "batches",
    "/v1/audio": "audio",
    "/v1/images": "images",
    "/v1/videos": "videos",
    "/v1/fine_tuning": "fine-tuning",
    "/v1/fine-tunes": "fine-tunes",
    "/v1/conversations": "conversations",
    "/v1/assistants": "assistants",
    "/v1/threads": "threads",
    "/v1/vector_stores": "vector stores",
    "/v1/realtime": "realtime",
    "/v1/evals": "evals",
    "/v1/containers": "containers",
    "/v1/edits": "edits",
    "/v1/engines": "engines",
}
SERVED = "chat completions, completions, responses, models, tokenize and detokenize"
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]


def unsupported_endpoint(path: str) -> APIError:
    name = UNSUPPORTED_ENDPOINTS[path]
    return APIError(
        404,
        f"This gateway does not serve OpenAI's {name} endpoint ({path}); it serves {SERVED}.",
        "invalid_request_error",
        "unsupported_endpoint",
    )


def unsupported_routes() -> list[BaseRoute]:
    """Every family's path, and each path below it."""
    routes: list[BaseRoute] = []
    for path in UNSUPPORTED_ENDPOINTS:

        async def refuse(request: Request, path: str = path) -> Response:
            return unsupported_endpoint(path).response()

        routes.append(Route(path, refuse, methods=_METHODS))
        routes.append(Route(path + "/{rest:path}", refuse, methods=_METHODS))
    return routes
