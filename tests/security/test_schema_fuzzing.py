"""Schema-driven fuzzing: every operation of the gateway's own OpenAPI document, valid and invalid data.

Schemathesis reads ``GET /openapi.json`` from the running gateway and sends, per operation,
requests built from the schema (positive mode) and requests that break it on purpose
(negative mode: wrong types, out-of-range numbers, missing and unknown fields). Every answer
must be no 5xx, conform to the document (status code, content type, body schema), never
accept invalid data, and, when an error, be one clean OpenAI error object.

Tenant routes are called with a tenant key, ``/admin`` routes with the admin key: the point
here is input handling behind authentication (the authorization matrix is its own test).
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.stack import StandInStack
from tests.security.checks import assert_no_server_error
from tests.security.conftest import FUZZ_CASES

import pytest

# Generation routes are where hostile input lands: they get the most examples.
GENERATION_EXAMPLES = 300
OTHER_EXAMPLES = 60
FUZZ_TENANT = "fuzz-tenant-7c1e"  # a name the fuzzer will not guess for /admin/.../disable


@pytest.fixture(scope="module")
def api_schema(stack: StandInStack) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(stack.gateway.url + "/openapi.json")
    schema.config.update(base_url=stack.gateway.url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=OTHER_EXAMPLES, deterministic=True)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=OTHER_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_fuzzed_request_gets_a_conforming_answer_and_never_a_server_error(
    case: schemathesis.Case, stack: StandInStack
) -> None:
    path = case.operation.path
    key = stack.gateway.admin_key if path.startswith("/admin") else stack.key(FUZZ_TENANT)
    response = case.call(headers={"Authorization": f"Bearer {key}"}, timeout=30)
    FUZZ_CASES[f"schemathesis {case.operation.method.upper()} {path}"] += 1
    assert_no_server_error(response.status_code, response.content)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                             content_type_conformance, response_schema_conformance,
                                             negative_data_rejection])


def _generation_examples(operation_path: str) -> int:
    return GENERATION_EXAMPLES if operation_path in ("/v1/chat/completions", "/v1/completions") else OTHER_EXAMPLES


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_routes_get_the_larger_fuzz_budget(api_schema: schemathesis.BaseSchema, stack: StandInStack,
                                                      path: str) -> None:
    """The two generation routes again, with ``GENERATION_EXAMPLES`` cases each."""
    operation = api_schema[path]["POST"]
    key = stack.key(FUZZ_TENANT)
    sent = 0

    @settings(max_examples=_generation_examples(path), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        response = case.call(headers={"Authorization": f"Bearer {key}"}, timeout=30)
        sent += 1
        assert_no_server_error(response.status_code, response.content)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance,
                                                 negative_data_rejection])

    from hypothesis import given

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        given(case=operation.as_strategy(generation_mode=mode))(run)()
    FUZZ_CASES[f"schemathesis (large budget) POST {path}"] += sent
    assert sent >= GENERATION_EXAMPLES  # the fuzzer really ran (negative mode may dedupe some)
