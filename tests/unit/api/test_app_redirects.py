"""The trailing-slash redirect names the path alone: the client's Host header is never written
into a Location (it was, whole, by Starlette's own redirect), and a path no route matches
either way is the OpenAI-format 404.

The app is called without its lifespan: what is tested answers before any handler runs.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.api.app import create_app
from gateway.config.settings import Settings

HOSTILE_HOST = "evil.example"


@pytest.fixture(scope="module")
def client() -> TestClient:
    # Not entered as a context manager: that would run the lifespan, which builds every
    # component, and nothing here needs one.
    return TestClient(
        create_app(Settings()), base_url=f"http://{HOSTILE_HOST}", follow_redirects=False
    )


@pytest.mark.parametrize(
    ("method", "path", "location"),
    [
        ("GET", "/healthz/", "/healthz"),
        ("GET", "/healthz/?verbose=1", "/healthz?verbose=1"),
        ("POST", "/v1/chat/completions/", "/v1/chat/completions"),
        ("POST", "/v1/tokenize/", "/v1/tokenize"),
    ],
)
def test_a_trailing_slash_redirects_to_the_path_without_the_host(
    client: TestClient, method: str, path: str, location: str
) -> None:
    response = client.request(method, path, headers={"Host": HOSTILE_HOST})
    assert response.status_code == 307
    assert response.headers["location"] == location
    assert HOSTILE_HOST not in response.text


@pytest.mark.parametrize("path", ["/nowhere", "/nowhere/", "//evil.example/", "/%2Fevil.example/"])
def test_a_path_no_route_matches_is_an_openai_404_without_a_location(
    client: TestClient, path: str
) -> None:
    response = client.get(path, headers={"Host": HOSTILE_HOST})
    assert response.status_code == 404
    assert "location" not in response.headers
    assert response.json()["error"]["code"] == "not_found"
