"""Every answer carries an ``x-request-id`` (the OpenAI SDK's ``_request_id``), and OpenAI's
endpoints that the gateway does not serve are a 404 ``unsupported_endpoint`` naming each, not
the generic ``not_found`` clients read as a wrong base URL.

The app is called without its lifespan: what is tested answers before any component is used.
(A generation's answers carry its generation ID as the request ID: ``test_pipeline_io`` for
the served head, ``tests/verification`` for the errors.)
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.api import openapi
from gateway.api.app import REQUEST_ID_PREFIX, create_app
from gateway.api.openapi import openapi_document
from gateway.api.unsupported import UNSUPPORTED_ENDPOINTS
from gateway.common.ids import PREFIX as GENERATION_PREFIX
from gateway.common.ids import is_generation_id
from gateway.config.settings import Settings


@pytest.fixture(scope="module")
def client() -> TestClient:
    # Not entered as a context manager: the lifespan would build every component.
    return TestClient(create_app(Settings()), follow_redirects=False)


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("POST", "/v1/embeddings", "embeddings"),
        ("POST", "/v1/moderations", "moderations"),
        ("GET", "/v1/files", "files"),
        ("POST", "/v1/files", "files"),
        ("DELETE", "/v1/files/file-abc123", "files"),
        ("POST", "/v1/batches", "batches"),
        ("GET", "/v1/batches/batch_1/cancel", "batches"),
        ("POST", "/v1/audio/transcriptions", "audio"),
        ("POST", "/v1/audio/speech", "audio"),
        ("POST", "/v1/images/generations", "images"),
        ("POST", "/v1/fine_tuning/jobs", "fine-tuning"),
        ("POST", "/v1/conversations", "conversations"),
        ("GET", "/v1/vector_stores/vs_1/files", "vector stores"),
    ],
)
def test_an_unsupported_openai_endpoint_is_a_404_that_names_it(
    client: TestClient, method: str, path: str, name: str
) -> None:
    response = client.request(method, path, json={"model": "m", "input": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "unsupported_endpoint"
    assert error["type"] == "invalid_request_error"
    assert f"OpenAI's {name} endpoint" in error["message"]
    assert "chat completions" in error["message"]  # what it serves instead


def test_a_path_of_no_endpoint_at_all_is_still_the_generic_404(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_the_openapi_document_lists_every_unsupported_endpoint_with_its_404() -> None:
    paths = openapi_document()["paths"]
    for path in UNSUPPORTED_ENDPOINTS:
        assert set(paths[path]["post"]["responses"]) == {"404"}, path


def test_the_openapi_document_is_built_with_the_app_not_at_the_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Building it takes tens of milliseconds, which at a request would hold the event loop.
    app = create_app(Settings())

    def built_while_serving() -> None:
        raise AssertionError("the OpenAPI document was built at a request")

    monkeypatch.setattr(openapi, "openapi_document", built_while_serving)
    response = TestClient(app).get("/openapi.json")
    assert response.status_code == 200
    assert response.json()["paths"].keys() == openapi_document()["paths"].keys()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/nowhere"),
        ("POST", "/v1/embeddings"),
        ("GET", "/healthz/"),
        ("GET", "/openapi.json"),
    ],
)
def test_every_answer_that_is_not_a_generations_has_a_fresh_request_id(
    client: TestClient, method: str, path: str
) -> None:
    first = client.request(method, path).headers["x-request-id"]
    second = client.request(method, path).headers["x-request-id"]
    assert first != second
    for request_id in (first, second):
        assert request_id.startswith(REQUEST_ID_PREFIX)
        # A generation ID's form under its own prefix: unique and time-sortable.
        assert is_generation_id(GENERATION_PREFIX + request_id[len(REQUEST_ID_PREFIX) :])
