"""The authorization matrix: every endpoint × every kind of caller, the expected status of each,
in one table.

Callers: no key; a malformed ``Authorization`` header; a well-formed key nobody issued; a revoked
key; the key of a disabled tenant; the key of another tenant (B) than the one that owns the
resource (A); the admin key; A's own key. Resources that belong to someone (an audit event,
``?tenant=``) belong to tenant A.

Every refusal must be an OpenAI error object, and a refused ``/admin`` call must change
nothing: each mutation acts on a target made for that one call, which is checked afterwards.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.reliability.stack import MODEL, StandInStack, chat_body
from tests.security.checks import assert_clean_error

CALLERS = ("none", "malformed", "unknown", "revoked", "disabled", "other_tenant", "admin", "own")


@dataclass
class World:
    """Tenants A (own), B (other) and D (disabled), a revoked key of A, and one of A's audit
    events."""

    stack: StandInStack
    own_tenant: str
    own_key: str
    other_key: str
    disabled_key: str
    revoked_key: str
    own_generation: str

    def headers(self, caller: str) -> dict[str, str]:
        bearer = {
            "none": None,
            "malformed": "Token " + self.own_key,  # right key, wrong scheme
            "unknown": "Bearer sk-iso-" + secrets.token_urlsafe(32),
            "revoked": "Bearer " + self.revoked_key,
            "disabled": "Bearer " + self.disabled_key,
            "other_tenant": "Bearer " + self.other_key,
            "admin": "Bearer " + self.stack.gateway.admin_key,
            "own": "Bearer " + self.own_key,
        }[caller]
        return {"Authorization": bearer} if bearer else {}

    def admin(self) -> httpx.Client:
        return self.stack.gateway.admin()

    def throwaway_tenant(self) -> str:
        tenant_id = "tmp-" + secrets.token_hex(4)
        with self.admin() as client:
            client.post("/admin/tenants", json={"id": tenant_id}).raise_for_status()
        return tenant_id

    def throwaway_key(self) -> str:
        with self.admin() as client:
            created = client.post(
                f"/admin/tenants/{self.own_tenant}/keys", json={"name": "throwaway"}
            )
            created.raise_for_status()
            return created.json()["id"]


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    unchanged: Callable[[World], None] | None = None  # asserted after a refused call


# An endpoint's request, built fresh per case (so mutations never share a target).
Endpoint = Callable[[World], Call]


def _tenant_absent(tenant_id: str) -> Callable[[World], None]:
    def check(world: World) -> None:
        with world.admin() as client:
            assert client.get(f"/admin/tenants/{tenant_id}").status_code == 404

    return check


def _tenant_enabled(tenant_id: str, disabled: bool = False) -> Callable[[World], None]:
    def check(world: World) -> None:
        with world.admin() as client:
            assert client.get(f"/admin/tenants/{tenant_id}").json()["disabled"] is disabled

    return check


def _key_live(key_id: str) -> Callable[[World], None]:
    def check(world: World) -> None:
        with world.admin() as client:
            assert client.get(f"/admin/keys/{key_id}").json()["revoked_at"] is None

    return check


def _key_count(tenant_id: str, before: int) -> Callable[[World], None]:
    def check(world: World) -> None:
        with world.admin() as client:
            assert len(client.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]) == before

    return check


def _create_tenant(world: World) -> Call:
    tenant_id = "new-" + secrets.token_hex(4)
    return Call("POST", "/admin/tenants", {"id": tenant_id}, _tenant_absent(tenant_id))


def _disable_tenant(world: World) -> Call:
    tenant_id = world.throwaway_tenant()
    return Call("POST", f"/admin/tenants/{tenant_id}/disable", None, _tenant_enabled(tenant_id))


def _enable_tenant(world: World) -> Call:
    tenant_id = world.throwaway_tenant()
    with world.admin() as client:
        client.post(f"/admin/tenants/{tenant_id}/disable").raise_for_status()
    return Call(
        "POST",
        f"/admin/tenants/{tenant_id}/enable",
        None,
        _tenant_enabled(tenant_id, disabled=True),
    )


def _create_key(world: World) -> Call:
    tenant_id = world.throwaway_tenant()
    return Call("POST", f"/admin/tenants/{tenant_id}/keys", {"name": "k"}, _key_count(tenant_id, 0))


def _revoke_key(method: str, suffix: str) -> Endpoint:
    def build(world: World) -> Call:
        key_id = world.throwaway_key()
        return Call(method, f"/admin/keys/{key_id}{suffix}", None, _key_live(key_id))

    return build


OK, CREATED = 200, 201
# (endpoint name, request builder, expected status per caller in CALLERS order)
#                                                             none malf unkn revk disb othr admn own
MATRIX: list[tuple[str, Endpoint, tuple[int, ...]]] = [
    (
        "POST /v1/chat/completions",
        lambda w: Call("POST", "/v1/chat/completions", chat_body()),
        (401, 401, 401, 401, 403, OK, 403, OK),
    ),
    (
        "POST /v1/completions",
        lambda w: Call(
            "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ),
        (401, 401, 401, 401, 403, OK, 403, OK),
    ),
    ("GET /v1/models", lambda w: Call("GET", "/v1/models"), (401, 401, 401, 401, 403, OK, OK, OK)),
    (
        "GET /v1/models/{id}",
        lambda w: Call("GET", f"/v1/models/{MODEL}"),
        (401, 401, 401, 401, 403, OK, OK, OK),
    ),
    (
        "POST /v1/tokenize",
        lambda w: Call("POST", "/v1/tokenize", {"model": MODEL, "prompt": "hi"}),
        (401, 401, 401, 401, 403, OK, 403, OK),
    ),
    (
        "POST /v1/detokenize",
        lambda w: Call("POST", "/v1/detokenize", {"model": MODEL, "tokens": [1, 2]}),
        (401, 401, 401, 401, 403, OK, 403, OK),
    ),
    (
        "GET /v1/audit/events",
        lambda w: Call("GET", "/v1/audit/events"),
        (401, 401, 401, 401, 403, OK, OK, OK),
    ),
    (
        "GET /v1/audit/events?tenant=A",
        lambda w: Call("GET", f"/v1/audit/events?tenant={w.own_tenant}"),
        (401, 401, 401, 401, 403, 403, OK, OK),
    ),
    (
        "GET /v1/audit/events/{A's event}",
        lambda w: Call("GET", f"/v1/audit/events/{w.own_generation}"),
        (401, 401, 401, 401, 403, 404, OK, OK),
    ),
    (
        "GET /v1/audit/events?generation_id=A's",
        lambda w: Call("GET", f"/v1/audit/events?generation_id={w.own_generation}"),
        (401, 401, 401, 401, 403, OK, OK, OK),
    ),  # 200 for B, but with no data: checked below
    ("POST /admin/tenants", _create_tenant, (401, 401, 401, 401, 403, 403, CREATED, 403)),
    (
        "GET /admin/tenants",
        lambda w: Call("GET", "/admin/tenants"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    (
        "GET /admin/tenants/{A}",
        lambda w: Call("GET", f"/admin/tenants/{w.own_tenant}"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    ("POST /admin/tenants/{t}/disable", _disable_tenant, (401, 401, 401, 401, 403, 403, OK, 403)),
    ("POST /admin/tenants/{t}/enable", _enable_tenant, (401, 401, 401, 401, 403, 403, OK, 403)),
    ("POST /admin/tenants/{t}/keys", _create_key, (401, 401, 401, 401, 403, 403, CREATED, 403)),
    (
        "GET /admin/tenants/{A}/keys",
        lambda w: Call("GET", f"/admin/tenants/{w.own_tenant}/keys"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    (
        "GET /admin/keys",
        lambda w: Call("GET", "/admin/keys"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    (
        "GET /admin/keys/{k}",
        lambda w: Call("GET", f"/admin/keys/{w.throwaway_key()}"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    (
        "POST /admin/keys/{k}/revoke",
        _revoke_key("POST", "/revoke"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    ("DELETE /admin/keys/{k}", _revoke_key("DELETE", ""), (401, 401, 401, 401, 403, 403, OK, 403)),
    (
        "GET /admin/workers",
        lambda w: Call("GET", "/admin/workers"),
        (401, 401, 401, 401, 403, 403, OK, 403),
    ),
    # Public: liveness, readiness and the API description. Metrics name tenants: admin only.
    ("GET /healthz", lambda w: Call("GET", "/healthz"), (OK,) * 8),
    ("GET /readyz", lambda w: Call("GET", "/readyz"), (OK,) * 8),
    ("GET /health", lambda w: Call("GET", "/health"), (OK,) * 8),
    ("GET /openapi.json", lambda w: Call("GET", "/openapi.json"), (OK,) * 8),
    ("GET /metrics", lambda w: Call("GET", "/metrics"), (401, 401, 401, 401, 403, 403, OK, 403)),
]

CASES = [
    (name, build, caller, statuses[index])
    for name, build, statuses in MATRIX
    for index, caller in enumerate(CALLERS)
]


@pytest.fixture(scope="module")
def world(stack: StandInStack) -> World:
    own_tenant, other_tenant, disabled_tenant = "tenant-a", "tenant-b", "tenant-d"
    own_key, other_key, disabled_key = (
        stack.key(own_tenant),
        stack.key(other_tenant),
        stack.key(disabled_tenant),
    )
    with stack.gateway.admin() as admin:
        revoked = admin.post(f"/admin/tenants/{own_tenant}/keys", json={"name": "revoked"}).json()
        admin.post(f"/admin/keys/{revoked['id']}/revoke").raise_for_status()
        admin.post(f"/admin/tenants/{disabled_tenant}/disable").raise_for_status()
    with stack.client(own_key) as client:
        served = client.post("/v1/chat/completions", json=chat_body())
        assert served.status_code == 200, served.text
        generation = served.json()["id"]
        # The audit writer is batched: wait until A's event is readable.
        for _ in range(100):
            if client.get(f"/v1/audit/events/{generation}").status_code == 200:
                break
            time.sleep(0.1)
    return World(stack, own_tenant, own_key, other_key, disabled_key, revoked["key"], generation)


@pytest.mark.parametrize(
    ("endpoint", "build", "caller", "expected"),
    CASES,
    ids=[f"{name} as {caller}" for name, _, caller, _ in CASES],
)
def test_each_endpoint_answers_each_caller_with_its_expected_status(
    world: World, endpoint: str, build: Endpoint, caller: str, expected: int
) -> None:
    call = build(world)
    with httpx.Client(base_url=world.stack.gateway.url, timeout=30) as client:
        response = client.request(
            call.method, call.path, json=call.json, headers=world.headers(caller)
        )
    assert response.status_code == expected, (
        f"{endpoint} as {caller}: {response.status_code} {response.text[:300]}"
    )
    if expected >= 400:
        error = assert_clean_error(response.status_code, response.content, statuses=(expected,))
        if expected == 401:
            assert error["type"] == "authentication_error"
        if call.unchanged is not None:
            call.unchanged(world)
    if endpoint.startswith("GET /v1/audit/events?generation_id") and caller == "other_tenant":
        assert response.json()["data"] == []  # B sees nothing of A's, not even that it exists
    if endpoint == "GET /v1/audit/events" and caller in ("own", "other_tenant"):
        tenant = world.own_tenant if caller == "own" else "tenant-b"
        assert all(event["tenant"] == tenant for event in response.json()["data"])


# Every endpoint a tenant's own key is served on (the /v1 rows of the matrix): several call
# sites authenticate (the generation pipeline, the model, tokenize and audit routes).
TENANT_ENDPOINTS = [
    (name, build)
    for name, build, statuses in MATRIX
    if name.split()[1].startswith("/v1/") and statuses[CALLERS.index("own")] == OK
]


def test_a_revoked_key_stays_refused_on_every_tenant_endpoint(world: World) -> None:
    """Revocation is not a cache race: a key in use, hence in the key cache, is refused on
    every call right after revoking, on every endpoint; another key of the same tenant is
    not."""
    with world.admin() as admin:
        raw = admin.post(f"/admin/tenants/{world.own_tenant}/keys", json={}).json()
        sibling = admin.post(f"/admin/tenants/{world.own_tenant}/keys", json={}).json()

    def statuses(key: str) -> dict[str, int]:
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=world.stack.gateway.url, timeout=30, headers=headers) as client:
            answers = {}
            for name, build in TENANT_ENDPOINTS:
                call = build(world)
                answers[name] = client.request(call.method, call.path, json=call.json).status_code
            return answers

    everywhere_ok = dict.fromkeys([name for name, _ in TENANT_ENDPOINTS], OK)
    # In use first, on every endpoint: the cache holds the key as valid when the revocation comes.
    assert statuses(raw["key"]) == everywhere_ok
    assert statuses(sibling["key"]) == everywhere_ok
    with world.admin() as admin:
        admin.post(f"/admin/keys/{raw['id']}/revoke").raise_for_status()
    for _ in range(3):
        assert statuses(raw["key"]) == dict.fromkeys(everywhere_ok, 401)
    # Revocation is per key, not per tenant: the tenant's other key is served everywhere.
    assert statuses(sibling["key"]) == everywhere_ok


def test_anonymous_clients_cannot_read_tenant_ids_from_metrics(world: World) -> None:
    body = httpx.get(world.stack.gateway.url + "/metrics", timeout=10).text
    assert world.own_tenant not in body
