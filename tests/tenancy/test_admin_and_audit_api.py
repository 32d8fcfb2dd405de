"""The admin API and ``GET /v1/audit/events`` over HTTP (ASGI), on PostgreSQL and SQLite."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from gateway.tenancy.store import Store, hash_key

from .conftest import admin_headers, key_headers

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def make_tenant_with_key(api: httpx.AsyncClient, tenant_id: str) -> str:
    response = await api.post("/admin/tenants", json={"id": tenant_id}, headers=admin_headers())
    assert response.status_code == 201, response.text
    response = await api.post(
        f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=admin_headers()
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


# -- admin API ---------------------------------------------------------------------------


async def test_admin_endpoints_refuse_tenant_keys_and_anonymous_callers(
    api: httpx.AsyncClient,
) -> None:
    tenant_key = await make_tenant_with_key(api, "acme")
    calls = [
        ("POST", "/admin/tenants", {"id": "other"}),
        ("GET", "/admin/tenants", None),
        ("GET", "/admin/tenants/acme", None),
        ("POST", "/admin/tenants/acme/disable", None),
        ("POST", "/admin/tenants/acme/keys", {}),
        ("GET", "/admin/tenants/acme/keys", None),
        ("GET", "/admin/keys", None),
        ("POST", "/admin/keys/key_x/revoke", None),
        ("DELETE", "/admin/keys/key_x", None),
    ]
    for method, path, body in calls:
        anonymous = await api.request(method, path, json=body)
        assert_openai_error(anonymous, 401, "invalid_api_key")
        as_tenant = await api.request(method, path, json=body, headers=key_headers(tenant_key))
        assert_openai_error(as_tenant, 403, "forbidden")
    listing = await api.get("/admin/tenants", headers=admin_headers())
    assert [t["id"] for t in listing.json()["data"]] == ["acme"]  # nothing was changed


async def test_tenant_lifecycle_with_validation_duplicates_and_unknown_ids(
    api: httpx.AsyncClient,
) -> None:
    created = await api.post(
        "/admin/tenants", json={"id": "acme", "name": "Acme"}, headers=admin_headers()
    )
    assert created.status_code == 201 and created.json()["name"] == "Acme"
    assert_openai_error(
        await api.post("/admin/tenants", json={"id": "acme"}, headers=admin_headers()),
        409,
        "conflict",
    )
    for bad in (
        {"id": ""},
        {"id": "Has Space"},
        {"id": "__admin__"},
        {"id": 5},
        {},
        {"id": "x" * 65},
        {"id": "ok", "name": 3},
        {"id": "ok", "extra": 1},
    ):
        assert_openai_error(
            await api.post("/admin/tenants", json=bad, headers=admin_headers()), 400
        )
    assert_openai_error(
        await api.post("/admin/tenants", content=b"{not json", headers=admin_headers()), 400
    )
    for method, path in (
        ("GET", "/admin/tenants/nope"),
        ("POST", "/admin/tenants/nope/disable"),
        ("POST", "/admin/tenants/nope/keys"),
        ("GET", "/admin/tenants/nope/keys"),
        ("POST", "/admin/keys/key_nope/revoke"),
        ("GET", "/admin/keys/key_nope"),
    ):
        assert_openai_error(await api.request(method, path, headers=admin_headers()), 404)
    disabled = await api.post("/admin/tenants/acme/disable", headers=admin_headers())
    assert disabled.json()["disabled"] is True
    enabled = await api.post("/admin/tenants/acme/enable", headers=admin_headers())
    assert enabled.json()["disabled"] is False


async def test_key_is_shown_once_and_stored_only_as_hash(
    api: httpx.AsyncClient, store: Store
) -> None:
    raw_key = await make_tenant_with_key(api, "acme")
    assert raw_key.startswith("sk-iso-")
    listings = [
        await api.get("/admin/keys", headers=admin_headers()),
        await api.get("/admin/tenants/acme/keys", headers=admin_headers()),
    ]
    for listing in listings:
        assert raw_key not in listing.text
        assert all("key" not in k for k in listing.json()["data"])
    key_id = listings[0].json()["data"][0]["id"]
    assert raw_key not in (await api.get(f"/admin/keys/{key_id}", headers=admin_headers())).text
    assert store.lookup_key(hash_key(raw_key)).key_id == key_id


async def test_revoked_key_stops_working_at_once(api: httpx.AsyncClient) -> None:
    raw_key = await make_tenant_with_key(api, "acme")
    assert (await api.get("/v1/audit/events", headers=key_headers(raw_key))).status_code == 200
    key_id = (await api.get("/admin/keys", headers=admin_headers())).json()["data"][0]["id"]
    revoked = await api.post(f"/admin/keys/{key_id}/revoke", headers=admin_headers())
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert_openai_error(
        await api.get("/v1/audit/events", headers=key_headers(raw_key)), 401, "invalid_api_key"
    )


async def test_disabled_tenant_is_refused_at_once_and_back_when_enabled(
    api: httpx.AsyncClient,
) -> None:
    raw_key = await make_tenant_with_key(api, "acme")
    assert (await api.get("/v1/audit/events", headers=key_headers(raw_key))).status_code == 200
    await api.post("/admin/tenants/acme/disable", headers=admin_headers())
    assert_openai_error(await api.get("/v1/audit/events", headers=key_headers(raw_key)), 403)
    await api.post("/admin/tenants/acme/enable", headers=admin_headers())
    assert (await api.get("/v1/audit/events", headers=key_headers(raw_key))).status_code == 200


# -- audit API ---------------------------------------------------------------------------


def seed_two_tenants(store: Store) -> dict[str, list[dict]]:
    """Interleaved events of two tenants sharing models, outcomes and timestamps."""
    rows: dict[str, list[dict]] = {"acme": [], "beta": []}
    outcomes = ("served", "rejected", "rate_limited", "verification_failed", "upstream_error")
    for i in range(60):
        for tenant in rows:
            rows[tenant].append(
                dict(
                    generation_id=f"gen-{tenant}-{i:03d}",
                    tenant_id=tenant,
                    key_id=f"key_{tenant}",
                    model=f"m{i % 2}",
                    outcome=outcomes[i % 5],
                    status=200,
                    code=None,
                    prefill_worker="p",
                    decode_worker="d",
                    prompt_tokens=i,
                    completion_tokens=i,
                    stream=False,
                    latency_ms=1.0,
                    created_at=T0 + timedelta(seconds=i // 2),
                    detail=None,
                )
            )
    store.insert_audit_rows(
        [row for pair in zip(rows["acme"], rows["beta"], strict=True) for row in pair]
    )
    return rows


async def collect(
    api: httpx.AsyncClient, headers: dict[str, str], params: dict[str, str]
) -> list[dict]:
    """Every page of a query, following next_cursor."""
    events: list[dict] = []
    cursor = None
    for _ in range(1000):
        page = await api.get(
            "/v1/audit/events",
            params={**params, **({"cursor": cursor} if cursor else {})},
            headers=headers,
        )
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["object"] == "list"
        events.extend(body["data"])
        cursor = body["next_cursor"]
        if cursor is None:
            return events
    raise AssertionError("pagination did not end")


async def test_tenant_key_never_reads_another_tenants_events_on_any_filter(
    api: httpx.AsyncClient, store: Store
) -> None:
    acme_key = await make_tenant_with_key(api, "acme")
    beta_key = await make_tenant_with_key(api, "beta")
    rows = seed_two_tenants(store)
    filters = {
        "since": [None, (T0 + timedelta(seconds=10)).isoformat()],
        "until": [None, (T0 + timedelta(seconds=20)).isoformat().replace("+00:00", "Z")],
        "outcome": [None, "served", "rate_limited"],
        "model": [None, "m1"],
        "generation_id": [None, "gen-acme-007", "gen-beta-007"],
        "limit": [None, "1", "7"],
    }
    checked = 0
    for values in itertools.product(*filters.values()):
        params = {
            name: value for name, value in zip(filters, values, strict=True) if value is not None
        }
        for tenant, key in (("acme", acme_key), ("beta", beta_key)):
            events = await collect(api, key_headers(key), params)
            assert all(e["tenant"] == tenant for e in events), (tenant, params)
            assert all(e["generation_id"].startswith(f"gen-{tenant}-") for e in events)
            # ...and it is the complete answer for that tenant, not just a safe one.
            expected = [r for r in rows[tenant] if matches(r, params)]
            assert sorted(e["generation_id"] for e in events) == sorted(
                r["generation_id"] for r in expected
            )
            checked += 1
    assert checked == 2 * 2 * 2 * 3 * 2 * 3 * 3

    # Naming the other tenant is refused outright; naming oneself is fine.
    for key, other in ((acme_key, "beta"), (beta_key, "acme")):
        assert_openai_error(
            await api.get("/v1/audit/events", params={"tenant": other}, headers=key_headers(key)),
            403,
        )
    own = await api.get(
        "/v1/audit/events", params={"tenant": "acme"}, headers=key_headers(acme_key)
    )
    assert own.status_code == 200 and {e["tenant"] for e in own.json()["data"]} == {"acme"}

    # A cursor made from the other tenant's page does not open the other tenant's events.
    beta_page = (
        await api.get("/v1/audit/events", params={"limit": "3"}, headers=key_headers(beta_key))
    ).json()
    crossed = await api.get(
        "/v1/audit/events",
        params={"cursor": beta_page["next_cursor"]},
        headers=key_headers(acme_key),
    )
    assert {e["tenant"] for e in crossed.json()["data"]} == {"acme"}

    # The single-event endpoint: another tenant's id is "not found", as if it did not exist.
    assert (await api.get("/v1/audit/events/gen-acme-001", headers=key_headers(acme_key))).json()[
        "tenant"
    ] == "acme"
    assert_openai_error(
        await api.get("/v1/audit/events/gen-beta-001", headers=key_headers(acme_key)), 404
    )
    assert_openai_error(
        await api.get("/v1/audit/events/gen-acme-001", headers=key_headers(beta_key)), 404
    )


def matches(row: dict, params: dict[str, str]) -> bool:
    if "since" in params and row["created_at"] < datetime.fromisoformat(params["since"]):
        return False
    if "until" in params and row["created_at"] >= datetime.fromisoformat(params["until"]):
        return False
    return all(
        row[name] == params[name]
        for name in ("outcome", "model", "generation_id")
        if name in params
    )


async def test_admin_reads_every_tenant_or_one(api: httpx.AsyncClient, store: Store) -> None:
    rows = seed_two_tenants(store)
    everything = await collect(api, admin_headers(), {"limit": "50"})
    assert len(everything) == 120 and {e["tenant"] for e in everything} == {"acme", "beta"}
    keys = [(e["created_at"], e["generation_id"]) for e in everything]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == 120  # newest first, each once
    beta_only = await collect(api, admin_headers(), {"tenant": "beta"})
    assert sorted(e["generation_id"] for e in beta_only) == sorted(
        r["generation_id"] for r in rows["beta"]
    )
    one = await api.get("/v1/audit/events/gen-beta-003", headers=admin_headers())
    assert one.json()["prompt_tokens"] == 3 and one.json()["tenant"] == "beta"


async def test_bad_audit_filters_are_400_in_openai_format(api: httpx.AsyncClient) -> None:
    key = await make_tenant_with_key(api, "acme")
    bad = [
        {"since": "yesterday"},
        {"until": "2026-13-01T00:00:00Z"},
        {"since": "2026-11-29T12:00:00"},
        {"limit": "0"},
        {"limit": "1001"},
        {"limit": "ten"},
        {"cursor": "not-a-cursor"},
        {"cursor": "WyJ4Il0"},
        {"outcome": "exploded"},
        {"tenantt": "acme"},
        {"since": "2026-11-29T12:00:00Z", "until": "2026-11-29T11:00:00Z"},
    ]
    for params in bad:
        error = assert_openai_error(
            await api.get("/v1/audit/events", params=params, headers=key_headers(key)), 400
        )
        assert error["type"] == "invalid_request_error"
    repeated = await api.get("/v1/audit/events?limit=1&limit=2", headers=key_headers(key))
    assert_openai_error(repeated, 400)
    assert_openai_error(await api.get("/v1/audit/events"), 401)


async def test_event_json_carries_every_field_and_no_text(
    api: httpx.AsyncClient, store: Store
) -> None:
    seed_two_tenants(store)
    event = (await api.get("/v1/audit/events/gen-acme-010", headers=admin_headers())).json()
    assert set(event) == {
        "object",
        "id",
        "generation_id",
        "tenant",
        "key_id",
        "model",
        "outcome",
        "status",
        "code",
        "prefill_worker",
        "decode_worker",
        "pool",
        "prompt_tokens",
        "completion_tokens",
        "stream",
        "latency_ms",
        "created_at",
        "detail",
        "policy_model",
    }
    assert event["id"] == "gen-acme-010" and event["created_at"] == "2026-11-29T12:00:05.000000Z"


async def test_a_responses_id_finds_its_event_at_once(
    api: httpx.AsyncClient, store: Store, settings
) -> None:
    from gateway.tenancy.audit import AuditEvent, AuditLog

    key = await make_tenant_with_key(api, "acme")
    # A flush interval far longer than the test: only the read-your-writes flush can help.
    audit = AuditLog(store, settings.model_copy(update={"audit_flush_interval_s": 60.0}))
    await audit.start()
    api.components.audit = audit  # type: ignore[attr-defined]  # set by the api fixture
    try:
        audit.record(
            AuditEvent(
                generation_id="gen_just_served",
                tenant_id="acme",
                key_id="key_x",
                model="m",
                outcome="served",
                status=200,
                code=None,
                prefill_worker="p",
                decode_worker="d",
                prompt_tokens=5,
                completion_tokens=6,
                stream=False,
                latency_ms=3.0,
                created_at=datetime.now(UTC),
            )
        )
        found = await api.get("/v1/audit/events/gen_just_served", headers=key_headers(key))
        assert found.status_code == 200 and found.json()["completion_tokens"] == 6
        audit.record(
            AuditEvent(
                generation_id="gen_next",
                tenant_id="acme",
                key_id="key_x",
                model="m",
                outcome="rejected",
                status=400,
                code="context_length_exceeded",
                prefill_worker=None,
                decode_worker=None,
                prompt_tokens=9000,
                completion_tokens=None,
                stream=True,
                latency_ms=1.0,
                created_at=datetime.now(UTC),
            )
        )
        listed = await api.get(
            "/v1/audit/events", params={"generation_id": "gen_next"}, headers=key_headers(key)
        )
        assert [e["code"] for e in listed.json()["data"]] == ["context_length_exceeded"]
    finally:
        await audit.close()
