"""The SQL store, against real PostgreSQL and SQLite (every test runs on both)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, inspect, select, text

from gateway.tenancy.store import (
    AuditQuery,
    AuditRowsRefused,
    Store,
    StoreConflict,
    StoreNotFound,
    api_keys,
    audit_events,
    audit_values,
    create_store,
    decode_cursor,
    hash_key,
    head_revision,
    metadata,
)

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def audit_row(
    generation_id: str,
    tenant_id: str,
    *,
    at: datetime = T0,
    outcome: str = "served",
    model: str = "m1",
    key_id: str | None = "key_x",
) -> dict[str, object]:
    return dict(
        generation_id=generation_id,
        tenant_id=tenant_id,
        key_id=key_id,
        model=model,
        outcome=outcome,
        status=200 if outcome == "served" else 429,
        code=None,
        prefill_worker="http://p:1",
        decode_worker="http://d:2",
        prompt_tokens=7,
        completion_tokens=3,
        stream=False,
        latency_ms=12.5,
        created_at=at,
        detail=None,
    )


def all_stored_text(store: Store, database_url: str) -> str:
    """Every value of every row of every table, plus (SQLite) the raw database files."""
    parts: list[str] = []
    with store.engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                parts.extend(str(value) for value in row)
    if database_url.startswith("sqlite"):
        path = Path(database_url.removeprefix("sqlite:///"))
        for file in path.parent.glob(path.name + "*"):
            parts.append(file.read_bytes().decode("latin-1"))
    return "\n".join(parts)


def test_raw_api_key_is_stored_nowhere_only_its_hash(store: Store, database_url: str) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme", "ci")
    stored = all_stored_text(store, database_url)
    assert raw_key not in stored
    assert raw_key.removeprefix("sk-iso-") not in stored
    assert hash_key(raw_key) in stored
    assert record.id in stored


def test_key_lookup_by_hash_finds_tenant_and_revocation(store: Store) -> None:
    store.create_tenant("acme")
    raw_key, record = store.create_key("acme")
    found = store.lookup_key(hash_key(raw_key))
    assert found is not None and (found.tenant_id, found.key_id, found.revoked) == (
        "acme",
        record.id,
        False,
    )
    revoked = store.revoke_key(record.id)
    assert revoked.revoked_at is not None
    assert store.lookup_key(hash_key(raw_key)).revoked is True
    # Revoking twice keeps the first revocation time.
    assert store.revoke_key(record.id).revoked_at == revoked.revoked_at
    assert store.lookup_key(hash_key(raw_key + "x")) is None


def test_disabled_tenant_shows_on_key_lookup(store: Store) -> None:
    store.create_tenant("acme")
    raw_key, _ = store.create_key("acme")
    store.set_tenant_disabled("acme", True)
    assert store.lookup_key(hash_key(raw_key)).tenant_disabled is True
    store.set_tenant_disabled("acme", False)
    assert store.lookup_key(hash_key(raw_key)).tenant_disabled is False


def test_duplicate_tenant_conflicts_and_unknown_ids_are_not_found(store: Store) -> None:
    store.create_tenant("acme", "Acme Inc")
    with pytest.raises(StoreConflict):
        store.create_tenant("acme")
    with pytest.raises(StoreNotFound):
        store.create_key("nobody")
    with pytest.raises(StoreNotFound):
        store.revoke_key("key_missing")
    with pytest.raises(StoreNotFound):
        store.set_tenant_disabled("nobody", True)
    assert [t.name for t in store.list_tenants()] == ["Acme Inc"]


def test_every_key_gets_a_distinct_secret_and_id(store: Store) -> None:
    store.create_tenant("acme")
    created = [store.create_key("acme") for _ in range(20)]
    assert len({raw for raw, _ in created}) == 20
    assert len({record.id for _, record in created}) == 20
    assert all(raw.startswith("sk-iso-") and len(raw) >= 40 for raw, _ in created)
    assert {k.id for k in store.list_keys("acme")} == {record.id for _, record in created}


def test_audit_insert_skips_generation_ids_already_stored(store: Store) -> None:
    rows = [audit_row(f"gen-{i}", "acme", at=T0 + timedelta(seconds=i)) for i in range(5)]
    store.insert_audit_rows(rows[:3])
    store.insert_audit_rows(rows)  # a replayed batch overlapping what is stored
    assert store.count_audit() == 5
    got, _ = store.query_audit(AuditQuery(tenant_id="acme"))
    assert [r["generation_id"] for r in got] == [f"gen-{i}" for i in reversed(range(5))]


def test_audit_batches_of_every_length_store_each_row_once_in_order(store: Store) -> None:
    # Around the SQLite slice of 64 rows: under it, exactly it, and whole slices plus a rest,
    # each batch overlapping the one before (a replay).
    lengths = (1, 63, 64, 65, 130)
    rows = [audit_row(f"gen-{i:04d}", "acme", at=T0 + timedelta(seconds=i)) for i in range(300)]
    start = stored = 0
    for length in lengths:
        store.insert_audit_rows(rows[start : start + length])
        stored = start + length
        start += length // 2
    assert store.count_audit() == stored
    with store.engine.connect() as conn:
        ordered = conn.execute(select(audit_events.c.generation_id).order_by(audit_events.c.seq))
        assert [generation_id for (generation_id,) in ordered] == [
            row["generation_id"] for row in rows[:stored]
        ]


def test_sqlite_audit_inserts_use_two_statement_texts_whatever_the_batch_lengths(
    store: Store,
) -> None:
    """The driver's statement cache must always hit: preparing a statement of tens of rows costs
    more than inserting them, and a text per batch length missed on every new length."""
    if store.dialect != "sqlite":
        pytest.skip("SQLite only: PostgreSQL inserts a batch through one unnest statement")
    statements: set[str] = set()

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("INSERT INTO audit_events"):
            statements.add(statement)

    event.listen(store.engine, "before_cursor_execute", seen)
    writer = store.sqlite_audit_writer()
    assert writer is not None
    start = 0
    try:
        for length in range(1, 140, 3):
            batch = [audit_row(f"gen-{i}", "acme") for i in range(start, start + length)]
            store.insert_audit_rows(batch[: length // 2])
            writer.insert([audit_values(row) for row in batch[length // 2 :]])
            start += length
    finally:
        writer.close()
        event.remove(store.engine, "before_cursor_execute", seen)
    assert store.count_audit() == start
    assert len(statements) == 2, sorted(len(s) for s in statements)


def test_audit_timestamps_round_trip_as_utc(store: Store) -> None:
    moment = datetime(2026, 11, 29, 14, 30, 15, 123456, tzinfo=UTC)
    store.insert_audit_rows([audit_row("gen-t", "acme", at=moment.astimezone(UTC))])
    got, _ = store.query_audit(AuditQuery(generation_id="gen-t"))
    assert got[0]["created_at"] == moment and got[0]["created_at"].utcoffset() == timedelta(0)


def test_audit_rows_are_stored_exactly_as_the_table_types_store_them(store: Store) -> None:
    # The SQLite insert binds values itself (no SQLAlchemy bind processors on the writer
    # thread); what it stores must be what the table's own insert stores, or text order stops
    # being time order (a whole second has no ".000000" in isoformat) and queries decode wrong.
    moments = [T0, T0 + timedelta(microseconds=500_000), T0 + timedelta(seconds=1)]
    stream_flags = [True, False, True]
    direct = [
        audit_row(f"direct-{i}", "acme", at=m) | {"stream": s}
        for i, (m, s) in enumerate(zip(moments, stream_flags, strict=True))
    ]
    with store.engine.begin() as conn:
        conn.execute(audit_events.insert(), direct)
    store.insert_audit_rows(
        [row | {"generation_id": row["generation_id"].replace("direct", "batch")} for row in direct]
    )
    with store.engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT generation_id, CAST(created_at AS TEXT), stream FROM audit_events "
                "ORDER BY created_at, generation_id"
            )
        ).all()
    assert [(g.split("-")[1], t, s) for g, t, s in stored][::2] == [
        (g.split("-")[1], t, s) for g, t, s in stored
    ][1::2]
    got, _ = store.query_audit(AuditQuery(tenant_id="acme", limit=10))
    assert [r["generation_id"] for r in got] == [
        "direct-2",
        "batch-2",
        "direct-1",
        "batch-1",
        "direct-0",
        "batch-0",
    ]
    assert [r["created_at"] for r in got][::2] == moments[::-1]
    assert [r["stream"] for r in got][::2] == stream_flags[::-1]


def test_an_audit_row_without_a_timezone_is_refused_not_stored(store: Store) -> None:
    with pytest.raises(AuditRowsRefused):
        store.insert_audit_rows([audit_row("naive", "acme", at=T0.replace(tzinfo=None))])
    assert store.count_audit() == 0


def test_audit_pages_walk_every_event_once_newest_first_with_equal_timestamps(store: Store) -> None:
    # Groups of three events share a timestamp: the keyset must break ties by generation id.
    rows = [audit_row(f"gen-{i:03d}", "acme", at=T0 + timedelta(seconds=i // 3)) for i in range(50)]
    store.insert_audit_rows(rows)
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page, cursor = store.query_audit(AuditQuery(tenant_id="acme", limit=7, after=after))
        seen.extend(r["generation_id"] for r in page)
        pages += 1
        if cursor is None:
            break
        after = decode_cursor(cursor)
    expected = [
        r["generation_id"]
        for r in sorted(rows, key=lambda r: (r["created_at"], r["generation_id"]), reverse=True)
    ]
    assert seen == expected
    assert pages == 8  # 7 full pages + 1 short one, no empty trailing page


def test_audit_filters_select_by_time_outcome_model_and_generation(store: Store) -> None:
    rows = [
        audit_row("a1", "acme", at=T0, outcome="served", model="m1"),
        audit_row("a2", "acme", at=T0 + timedelta(minutes=1), outcome="rate_limited", model="m1"),
        audit_row("a3", "acme", at=T0 + timedelta(minutes=2), outcome="served", model="m2"),
        audit_row("b1", "beta", at=T0 + timedelta(minutes=1), outcome="served", model="m1"),
    ]
    store.insert_audit_rows(rows)

    def ids(**filters: object) -> list[str]:
        return [r["generation_id"] for r in store.query_audit(AuditQuery(**filters))[0]]

    assert ids(tenant_id="acme") == ["a3", "a2", "a1"]
    assert ids(tenant_id="acme", since=T0 + timedelta(minutes=1)) == ["a3", "a2"]
    assert ids(tenant_id="acme", until=T0 + timedelta(minutes=1)) == ["a1"]
    assert ids(tenant_id="acme", outcome="served") == ["a3", "a1"]
    assert ids(tenant_id="acme", model="m1") == ["a2", "a1"]
    assert ids(tenant_id="acme", generation_id="a2") == ["a2"]
    assert ids(tenant_id="acme", generation_id="b1") == []
    assert ids() == ["a3", "b1", "a2", "a1"]


def test_migrate_upgrades_an_existing_database_keeping_its_data(database_url: str) -> None:
    old = create_store(database_url)
    old.migrate("0001")  # a database made by the first release: tenants and keys only
    assert old.current_revision() == "0001"
    old.create_tenant("acme", "Acme")
    raw_key, record = old.create_key("acme", "ci")
    old.migrate("0002")  # the audit log arrives; events are written, with its columns
    rows = [audit_row("g1", "acme"), audit_row("g2", "acme", at=T0 + timedelta(seconds=1))]
    with old.engine.begin() as conn:  # only the columns 0002 has (no pool)
        conn.execute(audit_events.insert(), rows)
    old.dispose()

    store = create_store(database_url)
    store.migrate()
    assert store.current_revision() == head_revision() != "0002"
    assert [t.id for t in store.list_tenants()] == ["acme"]
    lookup = store.lookup_key(hash_key(raw_key))
    assert lookup is not None and lookup.key_id == record.id
    assert [r["generation_id"] for r in store.query_audit(AuditQuery(tenant_id="acme"))[0]] == [
        "g2",
        "g1",
    ]
    store.insert_audit_rows([audit_row("g3", "acme")])
    store.migrate()  # again: nothing to do, nothing lost
    assert store.count_audit() == 3 and [k.id for k in store.list_keys()] == [record.id]
    store.dispose()


def test_migrations_build_exactly_the_schema_the_code_uses(store: Store) -> None:
    inspector = inspect(store.engine)
    for table in metadata.sorted_tables:
        migrated = {c["name"] for c in inspector.get_columns(table.name)}
        assert migrated == {c.name for c in table.columns}, table.name
        migrated_indexes = {i["name"] for i in inspector.get_indexes(table.name)}
        assert {i.name for i in table.indexes} <= migrated_indexes, table.name
    with store.engine.connect() as conn:
        assert conn.execute(select(api_keys)).all() == []
