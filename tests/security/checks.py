"""What every answer to a bad request must look like: a 4xx in the OpenAI error format, nothing
more."""

from __future__ import annotations

import re
from typing import Any

import orjson

# What a leaked stack trace or internal detail looks like in a body.
_LEAK_PATTERNS = re.compile(
    rb"Traceback \(most recent call last\)|File \"/|\.py\", line \d+|"
    rb"sqlalchemy\.|psycopg|pydantic_core|"
    rb"orjson\.JSONDecodeError|<class '|site-packages",
)


def assert_clean_error(
    status: int, body: bytes, *, statuses: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """The answer is a 4xx (or one of ``statuses``) whose body is exactly one OpenAI error
    object."""
    allowed = statuses or tuple(range(400, 500))
    assert status in allowed, f"status {status} not in {allowed}: {body[:300]!r}"
    assert not _LEAK_PATTERNS.search(body), f"internal detail leaked: {body[:500]!r}"
    payload = orjson.loads(body)
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def assert_no_server_error(status: int, body: bytes) -> None:
    """Any answer but a 5xx; an error answer is in the OpenAI format and leaks nothing."""
    assert status < 500, f"server error {status}: {body[:500]!r}"
    assert not _LEAK_PATTERNS.search(body), f"internal detail leaked: {body[:500]!r}"
    if status >= 400:
        assert_clean_error(status, body)
