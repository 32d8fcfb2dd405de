"""Schema-driven fuzzing: every operation of the gateway's own OpenAPI document, valid and invalid
data.

Schemathesis reads the document the gateway serves at ``GET /openapi.json`` and sends, per
operation, requests built from the schema (positive mode) and requests that break it on
purpose (negative mode: wrong types, out-of-range numbers, missing and unknown fields).
Every answer must be no 5xx, conform to the document (status code, content type, body
schema), never accept invalid data, and, when an error, be one clean OpenAI error object.

Tenant routes are called with a tenant key, ``/admin`` routes with the admin key: the point
here is input handling behind authentication (the authorization matrix is its own test).
The operations are listed at collection time from ``gateway.api.openapi`` and the served
document is checked to be that same document, so no route escapes.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
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
from tests.reliability.stack import MODEL, StandInStack
from tests.security.checks import assert_no_server_error
from tests.security.conftest import FUZZ_CASES

# Generation routes are where hostile input lands: they get the most examples.
GENERATION_EXAMPLES = 300
OTHER_EXAMPLES = 30
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
FUZZ_TENANT = "fuzz-tenant-7c1e"  # a name the fuzzer will not guess for /admin/.../disable
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


@pytest.fixture(scope="module")
def api_schema(stack: StandInStack) -> schemathesis.BaseSchema:
    served = httpx.get(stack.gateway.url + "/openapi.json", timeout=10).json()
    assert served == openapi_document()
    schema = schemathesis.openapi.from_dict(served)
    schema.config.update(base_url=stack.gateway.url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_fuzzed_request_gets_a_conforming_answer_and_never_a_server_error(
    api_schema: schemathesis.BaseSchema, stack: StandInStack, method: str, path: str
) -> None:
    operation = api_schema[path][method]
    key = stack.gateway.admin_key if path.startswith("/admin") else stack.key(FUZZ_TENANT)
    examples = GENERATION_EXAMPLES if path in GENERATION_ROUTES else OTHER_EXAMPLES
    sent = 0

    def run(mode: GenerationMode) -> None:
        @settings(
            max_examples=examples // 2,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case) -> None:
            nonlocal sent
            if (
                mode == GenerationMode.POSITIVE
                and path in GENERATION_ROUTES
                and isinstance(case.body, dict)
            ):
                # Valid bodies name the served model, so they travel the whole path (tokenize,
                # admit, dispatch, verify), not just to the model lookup; unknown models are
                # negative cases.
                case.body["model"] = MODEL
            # The tenant's (or admin's) key, unless the invalid part of a negative case is its
            # headers: a dropped or malformed Authorization is then the input under test, and
            # a valid key in its place would make the case a valid request.
            headers = {} if _headers_are_negative(case) else {"Authorization": f"Bearer {key}"}
            response = case.call(headers=headers, timeout=30)
            sent += 1
            assert_no_server_error(response.status_code, response.content)
            case.validate_response(response, checks=CHECKS)

        call()

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
    FUZZ_CASES[f"schemathesis {method} {path}"] += sent
    assert sent > 0


def _headers_are_negative(case: schemathesis.Case) -> bool:
    components = case.meta.components if case.meta is not None else {}
    header = components.get(ParameterLocation.HEADER)
    return header is not None and header.mode == GenerationMode.NEGATIVE
