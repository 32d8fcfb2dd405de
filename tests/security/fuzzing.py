"""What both Schemathesis targets share (the stand-in workers' and real SGLang's): the checks every
answer must pass, and the loop that sends one operation's generated cases.

Per operation, Schemathesis sends requests built from the gateway's own OpenAPI document
(positive mode) and requests that break it on purpose (negative mode: wrong types,
out-of-range numbers, missing and unknown fields). Every answer must be no 5xx, conform to the
document (status code, content type, body schema), never accept invalid data, and, when an
error, be one clean OpenAI error object; a target adds its own checks after each case.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.parameters import ParameterLocation

from gateway.api.openapi import openapi_document
from tests.security.checks import assert_no_server_error

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
OPERATIONS = [
    (method.upper(), path) for path, item in openapi_document()["paths"].items() for method in item
]
# The routes that reach the workers.
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

# Makes a generated case what the target means to send (a served model's name, say).
Prepare = Callable[[schemathesis.Case, GenerationMode], None]
# Checks what a case left behind, beyond its answer.
After = Callable[[schemathesis.Case, schemathesis.Response], None]


def served_schema(url: str, *, ours: bool = True) -> schemathesis.BaseSchema:
    """The document the gateway at ``url`` serves, set up to generate valid and invalid cases
    against it; with ``ours``, it must be this checkout's ``gateway.api.openapi`` (so no route
    escapes), else it is another checkout's gateway."""
    served = httpx.get(url + "/openapi.json", timeout=10).json()
    assert served == openapi_document() or not ours
    schema = schemathesis.openapi.from_dict(served)
    schema.config.update(base_url=url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    # An invalid body that is also over the size bound is refused for its size first: a 413,
    # which the document lists and Schemathesis's default refusals do not.
    refusals = schema.config.checks.negative_data_rejection
    refusals.expected_statuses = [*refusals.expected_statuses, "413"]
    return schema


def fuzz_operation(
    operation: schemathesis.APIOperation,
    *,
    key: str,
    positive: int,
    negative: int,
    prepare: Prepare,
    after: After | None = None,
    fuzz_seed: int | None = None,
    shrink: bool = True,
) -> int:
    """Sends up to ``positive`` valid cases and, where the operation has input to break,
    ``negative`` invalid ones, checks every answer (``CHECKS`` and ``after``), and returns how
    many were sent.

    Without ``fuzz_seed`` the cases are derandomized: the same ones every run, so that a landing
    is never blocked by a new random find. Without ``shrink`` a failing case is reported as
    found, not reduced by sending smaller ones (which a dead worker would answer the same way).
    """
    sent = 0
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]

    def run(mode: GenerationMode) -> None:
        @settings(
            max_examples=positive if mode == GenerationMode.POSITIVE else negative,
            deadline=None,
            derandomize=fuzz_seed is None,
            database=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case) -> None:
            nonlocal sent
            prepare(case, mode)
            # The key, unless the invalid part of a negative case is its headers: a dropped or
            # malformed Authorization is then the input under test, and a valid key in its
            # place would make the case a valid request.
            headers = {} if _headers_are_negative(case) else {"Authorization": f"Bearer {key}"}
            # Printed with a failure: the request itself, to replay (the case's repr is empty,
            # and its curl command masks every field named like a secret: min_tokens too).
            note(f"request: {case.method} {case.path} query={case.query!r}")
            note(f"headers={case.headers!r} body={case.body!r}")
            response = case.call(headers=headers, timeout=30)
            sent += 1
            assert_no_server_error(response.status_code, response.content)
            case.validate_response(response, checks=CHECKS)
            if after is not None:
                after(case, response)

        (call if fuzz_seed is None else seed(fuzz_seed)(call))()

    # An operation with no parameters and no body has no invalid input to generate.
    fuzzable = bool(
        operation.definition.raw.get("parameters") or operation.definition.raw.get("requestBody")
    )
    for mode in (
        (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if fuzzable
        else (GenerationMode.POSITIVE,)
    ):
        run(mode)
    return sent


def name_the_model(model: str) -> Prepare:
    """Valid bodies name the served model, so they travel the whole path (tokenize, admit,
    dispatch, verify), not just to the model lookup; unknown models are negative cases."""

    def prepare(case: schemathesis.Case, mode: GenerationMode) -> None:
        if (
            mode == GenerationMode.POSITIVE
            and case.operation.path in GENERATION_ROUTES
            and isinstance(case.body, dict)
        ):
            case.body["model"] = model

    return prepare


def _headers_are_negative(case: schemathesis.Case) -> bool:
    components = case.meta.components if case.meta is not None else {}
    header = components.get(ParameterLocation.HEADER)
    return header is not None and header.mode == GenerationMode.NEGATIVE
