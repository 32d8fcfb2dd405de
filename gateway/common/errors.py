"""OpenAI-format errors.

Every failure the gateway reports is an ``APIError``: one status, one ``type`` and one
``code``, rendered as ``{"error": {"message", "type", "param", "code"}}``. Handlers raise;
the app renders. Nothing else turns failures into responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

# How much of what a client sent an error quotes: enough to recognise it, never all of it (a
# 5 MB model name is not answered with a 5 MB error, nor written whole into the logs).
QUOTE_CHARS = 64
# The net under every message and ``param``, for one built from client input without ``quoted``:
# far above any message the gateway writes itself.
MESSAGE_CHARS = 1024
PARAM_CHARS = 256


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """Client input for an error message: quoted (control characters escaped, so it cannot
    break a log line) and cut to ``limit`` characters, an ellipsis saying it was cut."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + "…"


def clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # What the audit event says in place of the message: more than the client is told, or
    # less (where the message quotes the request's own content).
    audit_detail: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.message = clipped(self.message, MESSAGE_CHARS)
        if self.param is not None:
            self.param = clipped(self.param, PARAM_CHARS)

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def unauthorized(message: str = "Missing or invalid API key.") -> APIError:
    return APIError(401, message, "authentication_error", "invalid_api_key")


def forbidden(message: str) -> APIError:
    return APIError(403, message, "permission_error", "forbidden")


def not_found(message: str, *, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", code, param)


def model_not_found(name: str) -> APIError:
    return not_found(
        f"The model {quoted(name)} does not exist.", code="model_not_found", param="model"
    )


def rate_limited(message: str, retry_after_s: float) -> APIError:
    return APIError(
        429,
        message,
        "rate_limit_error",
        "rate_limit_exceeded",
        headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))},
    )


def unavailable(
    message: str, *, retry_after_s: float = 1.0, code: str = "no_worker_available"
) -> APIError:
    return APIError(
        503,
        message,
        "service_unavailable_error",
        code,
        headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))},
    )


def upstream_timeout(message: str) -> APIError:
    return APIError(504, message, "timeout_error", "upstream_timeout")


def upstream_failed(message: str) -> APIError:
    return APIError(502, message, "upstream_error", "upstream_error")


def isolation_check_failed(message: str) -> APIError:
    return APIError(502, message, "isolation_error", "isolation_check_failed")
