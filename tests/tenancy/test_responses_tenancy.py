"""Stored responses are a tenant's own, end to end: a real gateway process (stand-in workers) on
SQLite and on PostgreSQL.

Another tenant's response id, in ``retrieve``, ``delete``, ``input_items`` and as
``previous_response_id``, gets the very answer a missing id gets; a deleted response cannot be
chained from; an expired one is gone for every read, and the sweep deletes its row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.tenancy.store import create_store
from gateway.tenancy.stored_responses import stored_responses
from tests.reliability.stack import MODEL, StandInStack, standin_stack, wait_until
from tests.verification.stack import gateway_metric

# One tenant whose responses are kept for seconds (the retention is in days).
SHORT_LIVED = "shorty"
SHORT_RETENTION_S = 5.0
METERED = "metered"  # three requests a minute


@pytest.fixture
def stack(database_url: str, tmp_path: Path) -> Iterator[StandInStack]:
    env = {
        "ISOGATE_DATABASE_URL": database_url,
        "ISOGATE_RESPONSE_SWEEP_INTERVAL_S": "0.5",
        "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.05",
    }
    tenants = {
        SHORT_LIVED: {"response_retention_days": SHORT_RETENTION_S / 86400},
        METERED: {"limits": {"requests_per_minute": 3}},
    }
    with standin_stack(tmp_path, env=env, tenants=tenants) as running:
        yield running


def create(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    )


def every_use(client: httpx.Client, response_id: str) -> list[tuple[int, Any]]:
    """What each way of naming a response answers: retrieve, input_items, chain from it,
    delete (last: it deletes)."""
    answers = [
        client.get(f"/v1/responses/{response_id}"),
        client.get(f"/v1/responses/{response_id}/input_items"),
        create(client, previous_response_id=response_id),
        client.delete(f"/v1/responses/{response_id}"),
    ]
    return [(answer.status_code, answer.json()) for answer in answers]


def test_another_tenants_response_is_answered_as_a_missing_one_everywhere(
    stack: StandInStack,
) -> None:
    owner, other = stack.key("acme"), stack.key("globex")
    with stack.client(owner) as acme, stack.client(other) as globex:
        created = create(acme, input="Acme's secret question")
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]

        foreign = every_use(globex, response_id)

        # It was the owner's live response all along: readable and continued by the owner.
        assert acme.get(f"/v1/responses/{response_id}").json() == created.json()
        assert create(acme, previous_response_id=response_id).status_code == 200
        assert acme.delete(f"/v1/responses/{response_id}").status_code == 200

        # Deleted, it is missing for everyone: the same answers, byte for byte.
        missing = every_use(globex, response_id)
        owners_own = every_use(acme, response_id)
    assert foreign == missing == owners_own
    assert all(status == 404 for status, _ in foreign), foreign
    assert {body["error"]["code"] for _, body in foreign} == {"response_not_found"}
    assert "secret" not in str(foreign)


def test_a_deleted_response_cannot_be_chained_from(stack: StandInStack) -> None:
    with stack.client(stack.key("acme")) as acme:
        first = create(acme).json()["id"]
        assert create(acme, previous_response_id=first).status_code == 200
        assert acme.delete(f"/v1/responses/{first}").json() == {
            "id": first,
            "object": "response.deleted",
            "deleted": True,
        }
        chained = create(acme, previous_response_id=first)
    assert chained.status_code == 404
    assert chained.json()["error"]["param"] == "previous_response_id"


def test_each_response_is_one_audit_event_under_its_id(stack: StandInStack) -> None:
    with stack.client(stack.key("acme")) as acme:
        response_id = create(acme).json()["id"]
        refused = create(acme, previous_response_id="gen_nothing")

        def event(generation_id: str) -> dict[str, Any] | None:
            found = acme.get(f"/v1/audit/events/{generation_id}")
            return found.json() if found.status_code == 200 else None

        assert wait_until(lambda: event(response_id), timeout_s=10), "no event under its id"
        served = event(response_id)
        assert served is not None and served["outcome"] == "served"
        refused_id = refused.headers["x-generation-id"]
        assert wait_until(lambda: event(refused_id), timeout_s=10), "the refusal is not audited"
        refusal = event(refused_id)
        assert refusal is not None and refusal["status"] == 404
        listed = acme.get("/v1/audit/events", params={"limit": "100"}).json()["data"]
    assert [e["generation_id"] for e in listed].count(response_id) == 1


def test_an_expired_response_is_gone_and_the_sweep_deletes_it(
    stack: StandInStack, database_url: str
) -> None:
    store = create_store(database_url)

    def rows(response_id: str) -> int:
        with store.engine.connect() as conn:
            query = select(func.count()).where(stored_responses.c.id == response_id)
            return int(conn.execute(query).scalar_one())

    try:
        with stack.client(stack.key(SHORT_LIVED)) as client:
            response_id = create(client).json()["id"]
            assert rows(response_id) == 1  # stored (its retention has seconds to run)
            gone = wait_until(
                lambda: client.get(f"/v1/responses/{response_id}").status_code == 404,
                timeout_s=SHORT_RETENTION_S + 30,
            )
            assert gone, "still readable long after its retention"
            assert create(client, previous_response_id=response_id).status_code == 404
            assert client.get(f"/v1/responses/{response_id}/input_items").status_code == 404
        assert wait_until(lambda: rows(response_id) == 0, timeout_s=30), "never swept"
    finally:
        store.dispose()


def test_each_tenants_stored_responses_are_counted_for_the_operator(stack: StandInStack) -> None:
    with stack.client(stack.key("acme")) as acme, stack.client(stack.key("globex")) as globex:
        kept = [create(acme).json()["id"] for _ in range(3)]
        create(acme, store=False)
        create(globex)
        acme.delete(f"/v1/responses/{kept[0]}")

    def counts() -> list[float]:
        return [
            gateway_metric(stack.gateway, "isogate_stored_responses", tenant=tenant)
            for tenant in ("acme", "globex")
        ]

    assert wait_until(lambda: counts() == [2.0, 1.0], timeout_s=30), counts()


def test_the_stored_responses_routes_count_against_the_tenants_requests(
    stack: StandInStack,
) -> None:
    with stack.client(stack.key(METERED)) as client:
        response_id = create(client).json()["id"]  # the minute's first request
        answers = [client.get(f"/v1/responses/{response_id}") for _ in range(2)]
        answers.append(client.get(f"/v1/responses/{response_id}/input_items"))
        answers.append(client.delete(f"/v1/responses/{response_id}"))
    assert [a.status_code for a in answers] == [200, 200, 429, 429]
    assert answers[2].headers["retry-after"]
