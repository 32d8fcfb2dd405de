"""Schema-driven fuzzing against stand-in workers: every operation of the gateway's own OpenAPI
document, valid and invalid data (``tests.security.fuzzing`` says what is sent and checked).

Tenant routes are called with a tenant key, ``/admin`` routes with the admin key: the point
here is input handling behind authentication (the authorization matrix is its own test).
The operations are listed at collection time from ``gateway.api.openapi`` and the served
document is checked to be that same document, so no route escapes. The stand-ins answer
fast, so every route gets many cases; ``test_fuzz_real_engine`` sends the tenant routes to
real SGLang, which can crash where a stand-in cannot.
"""

from __future__ import annotations

import pytest
import schemathesis

from tests.reliability.stack import MODEL, StandInStack
from tests.security.conftest import FUZZ_CASES
from tests.security.fuzzing import (
    GENERATION_ROUTES,
    OPERATIONS,
    fuzz_operation,
    name_the_model,
    served_schema,
)

# Generation routes are where hostile input lands: they get the most examples.
GENERATION_EXAMPLES = 300
OTHER_EXAMPLES = 30
FUZZ_TENANT = "fuzz-tenant-7c1e"  # a name the fuzzer will not guess for /admin/.../disable


@pytest.fixture(scope="module")
def api_schema(stack: StandInStack) -> schemathesis.BaseSchema:
    return served_schema(stack.gateway.url)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_fuzzed_request_gets_a_conforming_answer_and_never_a_server_error(
    api_schema: schemathesis.BaseSchema, stack: StandInStack, method: str, path: str
) -> None:
    key = stack.gateway.admin_key if path.startswith("/admin") else stack.key(FUZZ_TENANT)
    examples = GENERATION_EXAMPLES if path in GENERATION_ROUTES else OTHER_EXAMPLES
    sent = fuzz_operation(
        api_schema[path][method],
        key=key,
        positive=examples // 2,
        negative=examples // 2,
        prepare=name_the_model(MODEL),
    )
    FUZZ_CASES[f"schemathesis {method} {path}"] += sent
    assert sent > 0
