"""The response models and the builders they describe stay one shape, and /openapi.json is valid.

``gateway.openai.protocol`` builds its answers as plain dicts and describes them with models, from
which the document is generated; ``GET /admin/workers`` does the same with a model of
``gateway.api.openapi``. Each builder's output, for every kind of answer it gives, must conform to
its model (``tests.schemas.assert_conforms``: strict, nothing missing or extra, and the served
document's schema too), so a field added to, dropped from or retyped in one and not the other
fails here. The admin and audit answers are held to their models in
``tests/tenancy/test_answer_schemas.py``, against real databases.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]  # no stubs in the test extras
import pydantic
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_31
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.api import answers
from gateway.api import openai_routes as api
from gateway.api.openapi import WorkerList, openapi_document
from gateway.common import errors
from gateway.openai import protocol
from gateway.workers.capacity import WorkerCapacity
from tests.schemas import assert_conforms, validate_with_document, validate_with_model

USAGE = answers.usage_of(7, 3, 2)
GID, MODEL, CREATED = "gen_01JDXYZ0000000000000000000", "tiny-llama", 1_764_000_000
FP = answers.system_fingerprint(MODEL, "/models/tiny-llama")
LOGPROBS = [
    protocol.TokenLogprob("H", -0.5, [("H", -0.5), ("h", -1.5)]),
    protocol.TokenLogprob("é", -0.25, [("é", -0.25)]),
]


# (model, builder output): every kind of answer each builder gives.
ANSWERS: list[tuple[type[pydantic.BaseModel], dict[str, Any]]] = [
    (protocol.Usage, USAGE),
    (protocol.Usage, answers.usage_of(0, 0, 0)),
    (
        protocol.ChatCompletion,
        answers.chat_completion(
            GID, MODEL, CREATED, [answers.chat_choice(0, "Hi", "stop", None)], USAGE, FP
        ),
    ),
    (
        protocol.ChatCompletion,
        answers.chat_completion(
            GID,
            MODEL,
            CREATED,
            [
                answers.chat_choice(0, "", "length", None),
                answers.chat_choice(1, "Hé", "stop", answers.chat_logprobs(LOGPROBS)),
            ],
            USAGE,
            FP,
        ),
    ),
    # A turn that only calls tools (content null), and one that reasoned first.
    (
        protocol.ChatCompletion,
        answers.chat_completion(
            GID,
            MODEL,
            CREATED,
            [
                answers.chat_choice(
                    0, "", "tool_calls", None, None, [answers.tool_call("call_1", "f", "{}")]
                ),
                answers.chat_choice(1, "Hi", "stop", None, "thinking"),
            ],
            USAGE,
            FP,
        ),
    ),
    (
        protocol.Completion,
        answers.completion(
            GID, MODEL, CREATED, [answers.completion_choice(0, "Hé ✓", "stop", None)], USAGE, FP
        ),
    ),
    (
        protocol.Completion,
        answers.completion(
            GID,
            MODEL,
            CREATED,
            [
                answers.completion_choice(0, "", "length", None),
                answers.completion_choice(
                    1, "Hé", "stop", answers.completion_logprobs(LOGPROBS, 3)
                ),
            ],
            USAGE,
            FP,
        ),
    ),
    # A chat stream: the role, text, then the finish reason with an empty delta.
    (
        protocol.ChatCompletionChunk,
        answers.chat_chunk(GID, MODEL, CREATED, {"role": "assistant", "content": ""}, None),
    ),
    (
        protocol.ChatCompletionChunk,
        answers.chat_chunk(GID, MODEL, CREATED, {"content": "Hi"}, None),
    ),
    (protocol.ChatCompletionChunk, answers.chat_chunk(GID, MODEL, CREATED, {}, "stop")),
    (protocol.ChatCompletionChunk, answers.chat_chunk(GID, MODEL, CREATED, {}, "tool_calls")),
    (
        protocol.ChatCompletionChunk,
        answers.chat_chunk(GID, MODEL, CREATED, {"reasoning_content": "hm"}, None),
    ),
    *(
        (
            protocol.ChatCompletionChunk,
            answers.chat_chunk(GID, MODEL, CREATED, {"tool_calls": [piece]}, None),
        )
        for piece in answers.tool_call_deltas(0, "call_1", "f", '{"a": 1}')
    ),
    (protocol.ChatCompletionChunk, answers.chat_chunk(GID, MODEL, CREATED, {}, "length")),
    (
        protocol.ChatCompletionChunk,
        answers.chat_chunk(GID, MODEL, CREATED, {"content": "Hé"}, None, 2, LOGPROBS),
    ),
    (
        protocol.CompletionChunk,
        answers.completion_chunk(GID, MODEL, CREATED, "Hé", None, 1, LOGPROBS, 5),
    ),
    (protocol.CompletionChunk, answers.completion_chunk(GID, MODEL, CREATED, "Hi", None)),
    (protocol.CompletionChunk, answers.completion_chunk(GID, MODEL, CREATED, "", "stop")),
    (
        protocol.UsageChunk,
        answers.usage_chunk(GID, MODEL, CREATED, "chat.completion.chunk", USAGE),
    ),
    (protocol.UsageChunk, answers.usage_chunk(GID, MODEL, CREATED, "text_completion", USAGE)),
    (protocol.ModelCard, protocol.model_card(MODEL, 0, 4096, "decode pool 'shared'")),
    (protocol.ModelCard, protocol.model_card(MODEL, 0, None, None)),
    (
        protocol.ModelList,
        protocol.model_list([protocol.model_card(MODEL, 0, 4096, "context_length")]),
    ),
    (protocol.ModelList, protocol.model_list([])),
]

# Every failure the gateway answers, from each constructor of gateway.common.errors.
ERRORS: list[errors.APIError] = [
    errors.bad_request("Missing required parameter: 'model'.", param="model"),
    errors.unauthorized(),
    errors.forbidden("A tenant key may not use /admin."),
    errors.not_found("No model 'x'.", code="model_not_found", param="model"),
    errors.rate_limited("Rate limit reached: 5 requests per minute.", 12.0),
    errors.unavailable("No worker is available now."),
    errors.upstream_timeout("The decode worker did not answer in time."),
    errors.upstream_failed("The prefill worker failed."),
    errors.isolation_check_failed("The answer failed an isolation check."),
    errors.APIError(500, "Internal error.", "server_error", "internal_error"),
]


ANSWER_IDS = [model.__name__ for model, _ in ANSWERS]


@pytest.mark.parametrize(("model", "answer"), ANSWERS, ids=ANSWER_IDS)
def test_every_builder_answer_conforms_to_its_model(
    model: type[pydantic.BaseModel], answer: dict[str, Any]
) -> None:
    assert_conforms(model, answer)


@pytest.mark.parametrize("error", ERRORS, ids=[f"{e.status} {e.code}" for e in ERRORS])
def test_every_error_body_conforms_to_the_error_model(error: errors.APIError) -> None:
    assert_conforms(protocol.ErrorResponse, error.body())


def with_extra_field(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "unexpected": 1}


def without_a_field(answer: dict[str, Any]) -> dict[str, Any]:
    return dict(list(answer.items())[1:])


def with_a_field_retyped(answer: dict[str, Any]) -> dict[str, Any]:
    first = next(iter(answer))
    return {**answer, first: [answer[first]]}


@pytest.mark.parametrize("drift", [with_extra_field, without_a_field, with_a_field_retyped])
@pytest.mark.parametrize(("model", "answer"), ANSWERS, ids=ANSWER_IDS)
def test_an_answer_drifted_from_its_model_is_refused_by_model_and_document(
    model: type[pydantic.BaseModel],
    answer: dict[str, Any],
    drift: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """The check above can fail: the model and the document each refuse what builders do not
    send."""
    drifted = drift(answer)
    with pytest.raises(pydantic.ValidationError):
        validate_with_model(model, drifted)
    with pytest.raises(jsonschema.ValidationError):
        validate_with_document(model.__name__, drifted)


def test_admin_workers_answer_conforms_to_its_model() -> None:
    fresh = WorkerCapacity(
        url="http://prefill:30000",
        role="prefill",
        observed_at=1_764_000_000.25,
        max_total_num_tokens=8192,
        max_req_input_len=8190,
        context_length=None,
        page_size=1,
        used_tokens=512,
        engine_patch="0.3.0",
    )
    states = {fresh.url: fresh}
    components = types.SimpleNamespace(
        authenticator=types.SimpleNamespace(require_admin=_admit),
        workers=lambda: [(fresh.url, "prefill"), ("http://decode:30001", "decode")],
        capacity=types.SimpleNamespace(
            get=states.get,
            fresh=lambda url: url in states,
            alive=lambda url: url in states,
            error=lambda url: None if url in states else "connection refused",
            liveness_error=lambda url: None if url in states else "connection refused",
        ),
        ledger=types.SimpleNamespace(claimed={fresh.url: 300}),
    )
    app = Starlette(routes=[Route("/admin/workers", api.workers, methods=["GET"])])
    app.state.components = components

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/admin/workers")

    response = asyncio.run(get())
    assert response.status_code == 200, response.text
    body = response.json()
    assert [w["fresh"] for w in body["data"]] == [True, False]  # both shapes of a record
    assert_conforms(WorkerList, body)


async def _admit(authorization: str | None) -> None:
    return None


def test_the_document_is_valid_openapi_3_1_and_every_ref_resolves() -> None:
    document = openapi_document()
    jsonschema.validate(document, OPENAPI_31, cls=jsonschema.Draft202012Validator)
    schemas = document["components"]["schemas"]
    for name, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "$defs" not in schema, name  # nested models are components of their own
    refs = set(references(document))
    assert refs and refs <= {f"#/components/schemas/{name}" for name in schemas}


def references(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in references(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in references(value)]
    return []


def test_every_response_model_is_a_component_and_every_route_answer_names_one() -> None:
    schemas = openapi_document()["components"]["schemas"]
    for model, _ in ANSWERS:
        assert model.__name__ in schemas
    assert "ErrorResponse" in schemas and "WorkerList" in schemas
    for path, item in openapi_document()["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                for media, content in response.get("content", {}).items():
                    if media == "application/json" and path != "/openapi.json":
                        assert "$ref" in content["schema"], (method, path, status)
