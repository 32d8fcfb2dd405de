"""Stored responses in the gateway's database, against real PostgreSQL and SQLite (every test runs
on both): a tenant reads, continues and deletes its own responses only, and an expired one is
gone for every read before the sweep deletes it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from sqlalchemy import event, inspect, select

from gateway.tenancy.store import Store
from gateway.tenancy.stored_responses import ResponseStore, StoredResponse, stored_responses

T0 = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)


def record(
    response_id: str, tenant_id: str, *, at: datetime = T0, days: float = 30
) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        tenant_id=tenant_id,
        model="m1",
        created_at=at,
        expires_at=at + timedelta(days=days),
        response={"id": response_id, "object": "response", "output": [{"text": tenant_id}]},
        input_items=[{"id": "msg_1", "type": "message", "text": f"{tenant_id} asked"}],
        context=[{"type": "message", "role": "user", "content": f"{tenant_id}'s conversation"}],
    )


@pytest.fixture
def responses(store: Store) -> ResponseStore:
    return ResponseStore(store)


def every_read(
    responses: ResponseStore, tenant_id: str, response_id: str, now: datetime
) -> list[Any]:
    response = responses.response_json(tenant_id, response_id, now)
    return [
        None if response is None else orjson.loads(response),
        responses.input_items(tenant_id, response_id, now),
        responses.context(tenant_id, response_id, now),
    ]


def test_the_migration_builds_the_table_the_store_uses(store: Store) -> None:
    inspector = inspect(store.engine)
    assert {c["name"] for c in inspector.get_columns("stored_responses")} == {
        c.name for c in stored_responses.columns
    }
    indexes = {i["name"] for i in inspector.get_indexes("stored_responses")}
    assert {i.name for i in stored_responses.indexes} <= indexes


def test_a_tenant_reads_back_what_it_stored(responses: ResponseStore) -> None:
    stored = record("gen_a", "acme")
    responses.save(stored)
    now = T0 + timedelta(hours=1)
    assert every_read(responses, "acme", "gen_a", now) == [
        stored.response,
        stored.input_items,
        stored.context,
    ]


def test_another_tenants_response_reads_exactly_as_a_missing_one(responses: ResponseStore) -> None:
    responses.save(record("gen_a", "acme"))
    now = T0 + timedelta(hours=1)
    assert every_read(responses, "globex", "gen_a", now) == [None, None, None]
    assert every_read(responses, "globex", "gen_missing", now) == [None, None, None]
    assert responses.delete("globex", "gen_a", now) is False
    assert responses.delete("globex", "gen_missing", now) is False
    # The owner's response is untouched by the other tenant's delete.
    assert responses.response_json("acme", "gen_a", now) is not None


def test_the_tenant_is_in_the_querys_where_clause_not_checked_after(
    responses: ResponseStore, store: Store
) -> None:
    """Every statement that reads or deletes a stored response names the tenant itself: a
    row of another tenant is never fetched into the gateway at all."""
    responses.save(record("gen_a", "acme"))
    statements: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "stored_responses" in statement:
            statements.append((statement, parameters))

    engines = {store.engine, store.reader}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", seen)
    try:
        now = T0 + timedelta(hours=1)
        every_read(responses, "globex", "gen_a", now)
        responses.delete("globex", "gen_a", now)
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", seen)
    assert len(statements) == 4
    for statement, parameters in statements:
        where = statement.upper().split("WHERE", 1)[1]
        assert "TENANT_ID" in where and "EXPIRES_AT" in where, statement
        values = parameters.values() if isinstance(parameters, dict) else parameters
        assert "globex" in list(values), (statement, parameters)


def test_a_deleted_response_is_gone_and_deleting_again_finds_nothing(
    responses: ResponseStore,
) -> None:
    responses.save(record("gen_a", "acme"))
    now = T0 + timedelta(hours=1)
    assert responses.delete("acme", "gen_a", now) is True
    assert every_read(responses, "acme", "gen_a", now) == [None, None, None]
    assert responses.delete("acme", "gen_a", now) is False


def test_a_response_past_its_retention_is_gone_before_any_sweep(responses: ResponseStore) -> None:
    responses.save(record("gen_a", "acme", days=1))
    assert responses.response_json("acme", "gen_a", T0 + timedelta(hours=23)) is not None
    expired = T0 + timedelta(days=1)
    assert every_read(responses, "acme", "gen_a", expired) == [None, None, None]
    assert responses.delete("acme", "gen_a", expired) is False


def test_the_sweep_deletes_expired_responses_only_in_bounded_batches(
    responses: ResponseStore, store: Store
) -> None:
    for n in range(5):
        responses.save(record(f"gen_old{n}", "acme", days=1))
    responses.save(record("gen_new", "acme", days=30))
    responses.save(record("gen_other", "globex", days=30))
    later = T0 + timedelta(days=2)
    assert responses.sweep(later, batch=2) == 5
    with store.engine.connect() as conn:
        left = sorted(conn.execute(select(stored_responses.c.id)).scalars())
    assert left == ["gen_new", "gen_other"]
    assert responses.sweep(later, batch=2) == 0


def test_counts_are_each_tenants_live_responses(responses: ResponseStore) -> None:
    responses.save(record("gen_a", "acme", days=1))
    responses.save(record("gen_b", "acme", days=30))
    responses.save(record("gen_c", "globex", days=30))
    assert responses.counts(T0 + timedelta(hours=1)) == {"acme": 2, "globex": 1}
    assert responses.counts(T0 + timedelta(days=2)) == {"acme": 1, "globex": 1}
