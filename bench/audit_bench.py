"""Audit log bench, one database at a time in a scratch copy migrated by the real migrations:
batched ``Store`` inserts, the whole ``AuditLog`` writer, then ``Store.query_audit`` shapes once
the table holds ``total_rows`` events (loaded in SQL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import text
from sqlalchemy.engine import make_url

from bench.processes import cpu_seconds
from bench.stream_client import percentile
from gateway.config.settings import Settings
from gateway.tenancy.audit import AuditEvent, AuditLog
from gateway.tenancy.store import (
    AuditQuery,
    Store,
    audit_events,
    create_store,
    decode_cursor,
    normalize_url,
)

DEFAULT_POSTGRES_URL = os.environ.get(
    "ISOGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
OUTCOMES = ("served",) * 17 + ("rejected", "rate_limited", "upstream_error")
BASE_TIME = datetime(2026, 1, 1, tzinfo=UTC)


def run_audit_bench(
    database_url: str, *, total_rows: int = 1_000_000, tenants: int = 100,
    insert_events: int = 50_000, queries: int = 300, batch_size: int = 500,
) -> dict[str, Any]:  # fmt: skip
    with _scratch_database(database_url) as url:
        store = create_store(url, migrate=True)
        try:
            return _measure(store, url, total_rows, tenants, insert_events, queries, batch_size)
        finally:
            store.dispose()


def _measure(
    store: Store, url: str, total_rows: int, tenants: int, insert_events: int, queries: int,
    batch_size: int,
) -> dict[str, Any]:  # fmt: skip
    result: dict[str, Any] = {
        "database": store.dialect,
        "total_rows": total_rows,
        "tenants": tenants,
        "load_average_1m_at_start": os.getloadavg()[0],
    }

    # 1. Batched inserts through the store, as the writer does them.
    rows = [_event(i, tenants).values() for i in range(insert_events)]
    backend = _backend_cpu_probe(store)
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, len(rows), batch_size):
        store.insert_audit_values(rows[start : start + batch_size])
    result["store_insert_events_per_s"] = round(insert_events / (time.perf_counter() - started))
    # CPU per event, which a busy shared machine inflates less than wall time: the gateway's,
    # and (PostgreSQL on this host) the database backend's.
    client_cpu_s = time.process_time() - cpu_started
    result["store_insert_client_cpu_us_per_event"] = round(client_cpu_s / insert_events * 1e6, 1)
    if (server_cpu_s := backend()) is not None:
        result["store_insert_server_cpu_us_per_event"] = round(
            server_cpu_s / insert_events * 1e6, 1
        )

    # 2. The whole audit writer: record() then close().
    with tempfile.TemporaryDirectory() as spool:
        spool_dir = Path(spool)
        settings = Settings(
            database_url=url, audit_spool_dir=spool_dir, audit_batch_size=batch_size, _env_file=None
        )
        events = [_event(insert_events + i, tenants) for i in range(insert_events)]
        rate = asyncio.run(_writer_throughput(store, settings, events))
        result["audit_log_events_per_s"] = round(rate)

    # 3. Fill up to total_rows in bulk (SQL-side generation), then query.
    started = time.perf_counter()
    _bulk_fill(store, total_rows - store.count_audit(), tenants, offset=2 * insert_events)
    result["bulk_fill_s"] = round(time.perf_counter() - started, 1)
    result["stored_rows"] = store.count_audit()

    tenant_ids = [f"tenant-{i:03d}" for i in range(tenants)]
    rng = random.Random(7)

    def tenant() -> str:
        return rng.choice(tenant_ids)

    def page_two() -> AuditQuery:  # the page after a tenant's newest 100
        first, cursor = store.query_audit(AuditQuery(tenant_id=tenant(), limit=100))
        return AuditQuery(tenant_id=first[0]["tenant_id"], limit=100, after=decode_cursor(cursor))

    shapes: dict[str, Callable[[], AuditQuery]] = {
        "tenant_newest_100": lambda: AuditQuery(tenant_id=tenant(), limit=100),
        "tenant_newest_100_page_2": page_two,
        "tenant_outcome_rate_limited_100": lambda: AuditQuery(
            tenant_id=tenant(), outcome="rate_limited", limit=100
        ),
        "all_tenants_newest_100": lambda: AuditQuery(limit=100),
    }
    for name, make_query in shapes.items():
        timings = []
        cpu_started = time.process_time()
        for _ in range(queries):
            query = make_query()
            started = time.perf_counter()
            page, _ = store.query_audit(query)
            timings.append((time.perf_counter() - started) * 1000)
            assert len(page) == 100 or "outcome" in name, (name, len(page))
        result[f"query_{name}_p50_ms"] = round(statistics.median(timings), 2)
        result[f"query_{name}_p99_ms"] = round(percentile(sorted(timings), 0.99), 2)
        # Client CPU per query (page 2 includes its first page), steadier than wall time.
        cpu_ms = (time.process_time() - cpu_started) / queries * 1000
        result[f"query_{name}_client_cpu_ms"] = round(cpu_ms, 2)
    result["plan_tenant_newest_100"] = _plan(store, tenant_ids[0])
    if store.dialect == "postgresql":
        result["server_exec_tenant_newest_100_p50_ms"] = _server_ms(store, tenant_ids, rng)
    result["load_average_1m_at_end"] = os.getloadavg()[0]
    return result


async def _writer_throughput(store: Store, settings: Settings, events: list[AuditEvent]) -> float:
    audit = AuditLog(store, settings)
    await audit.start()
    started = time.perf_counter()
    for event in events:
        audit.record(event)
    await audit.close()
    return len(events) / (time.perf_counter() - started)


def _event(i: int, tenants: int) -> AuditEvent:
    outcome = OUTCOMES[(i // tenants) % len(OUTCOMES)]
    return AuditEvent(
        generation_id=f"bench-{i:09d}",
        tenant_id=f"tenant-{i % tenants:03d}",
        key_id=f"key_{i % 997:016x}",
        model="glm-5" if i % 3 else "tiny-llama",
        outcome=outcome,
        status=200 if outcome == "served" else 429,
        code=None if outcome == "served" else outcome,
        prefill_worker="http://prefill-3:30000",
        decode_worker="http://decode-1:30001",
        prompt_tokens=i % 4096,
        completion_tokens=i % 512,
        stream=bool(i % 2),
        latency_ms=(i % 1000) / 3,
        created_at=BASE_TIME + timedelta(milliseconds=i * 10),
        detail=None,
    )


def _bulk_fill(store: Store, count: int, tenants: int, *, offset: int) -> None:
    """``count`` more events, generated inside the database: 10 ms apart, tenants round robin."""
    if count <= 0:
        return
    # Outcomes cycle per tenant (on i / tenants), so every tenant has some of each.
    n = f"((i / {tenants}) % 20)"
    outcome_case = (
        f"CASE WHEN {n} = 17 THEN 'rejected' WHEN {n} = 18 THEN 'rate_limited' "
        f"WHEN {n} = 19 THEN 'upstream_error' ELSE 'served' END"
    )
    columns = (
        "generation_id, tenant_id, key_id, model, outcome, status, code, prefill_worker, "
        "decode_worker, prompt_tokens, completion_tokens, stream, latency_ms, created_at, detail"
    )
    # Loading without the indexes and building them afterwards (one sort each) is several
    # times faster than maintaining them row by row; they are rebuilt from the same
    # definitions the migrations use, so the queries measured use the deployed indexes.
    indexes = sorted(audit_events.indexes, key=lambda index: index.name)
    with store.engine.begin() as conn:
        for index in indexes:
            index.drop(conn)
    last = offset + count - 1
    # Per dialect: where the rows come from, the zero-padded ids, the stream flag, the time.
    if store.dialect == "postgresql":
        source, rows, stream = "", f"generate_series({offset}, {last}) AS i", "i % 2 = 1"
        ids = ["lpad(i::text, 9, '0')", f"lpad((i % {tenants})::text, 3, '0')"]
        ids.append("lpad(to_hex(i % 997), 16, '0')")
        created = "TIMESTAMPTZ '2026-01-01 00:00:00+00' + i * INTERVAL '10 milliseconds'"
    else:
        source = f"WITH RECURSIVE s(i) AS (SELECT {offset} UNION ALL SELECT i + 1 FROM s "
        source += f"WHERE i < {last})"
        rows, stream = "s", "i % 2"
        ids = ["printf('%09d', i)", f"printf('%03d', i % {tenants})", "printf('%016x', i % 997)"]
        created = "strftime('%Y-%m-%d %H:%M:%S', '2026-01-01', '+' || (i / 100) || ' seconds')"
        created += " || '.' || printf('%06d', (i % 100) * 10000)"
    insert = f"""
        {source} INSERT INTO audit_events ({columns})
        SELECT 'bench-' || {ids[0]}, 'tenant-' || {ids[1]}, 'key_' || {ids[2]},
               CASE WHEN i % 3 = 0 THEN 'tiny-llama' ELSE 'glm-5' END,
               {outcome_case}, CASE WHEN {n} < 17 THEN 200 ELSE 429 END, NULL,
               'http://prefill-3:30000', 'http://decode-1:30001', i % 4096, i % 512, {stream},
               (i % 1000) / 3.0, {created}, NULL
        FROM {rows}
    """
    with store.engine.begin() as conn:
        conn.execute(text(insert))
    with store.engine.begin() as conn:
        for index in indexes:
            index.create(conn)
        conn.execute(text("ANALYZE audit_events" if store.dialect == "postgresql" else "ANALYZE"))


def _backend_cpu_probe(store: Store) -> Callable[[], float | None]:
    """The CPU seconds the PostgreSQL backend serving the store's (single, reused) write
    connection spends from now to each call; None when unknown."""
    if store.dialect != "postgresql":
        return lambda: None
    with store.engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    try:
        before = cpu_seconds(pid)
    except OSError:  # a database on another host
        return lambda: None

    def spent() -> float | None:
        if store.engine.pool.checkedin() != 1:  # another connection did part of the work
            return None
        with contextlib.suppress(OSError):
            return cpu_seconds(pid) - before
        return None

    return spent


NEWEST_100 = (
    "SELECT * FROM audit_events WHERE tenant_id = :t "
    "ORDER BY created_at DESC, generation_id DESC LIMIT 101"
)


def _server_ms(store: Store, tenant_ids: list[str], rng: random.Random) -> float:
    """PostgreSQL's own execution time for the newest-100 query (EXPLAIN ANALYZE), median."""
    query = text("EXPLAIN (ANALYZE, FORMAT JSON) " + NEWEST_100)
    with store.engine.connect() as conn:
        plans = [conn.execute(query, {"t": rng.choice(tenant_ids)}).scalar_one() for _ in range(50)]
    return round(statistics.median(plan[0]["Execution Time"] for plan in plans), 3)


def _plan(store: Store, tenant_id: str) -> str:
    """The query plan of the newest-100 query, to show it walks the index without sorting."""
    explain = "EXPLAIN " if store.dialect == "postgresql" else "EXPLAIN QUERY PLAN "
    with store.engine.connect() as conn:
        rows = conn.execute(text(explain + NEWEST_100), {"t": tenant_id}).all()
    return " | ".join(str(r[0] if store.dialect == "postgresql" else r[-1]).strip() for r in rows)


@contextlib.contextmanager
def _scratch_database(database_url: str) -> Iterator[str]:
    """A fresh SQLite file, or a fresh PostgreSQL schema (dropped on exit)."""
    url = make_url(normalize_url(database_url))
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            yield normalize_url(database_url)
            return
        with tempfile.TemporaryDirectory() as directory:
            yield f"sqlite:///{directory}/audit-bench.db"
        return
    import psycopg

    schema = "isogate_bench_" + secrets.token_hex(4)
    libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    rendered = url.render_as_string(hide_password=False)
    options = quote(f"-csearch_path={schema}")
    try:
        yield f"{rendered}{'&' if '?' in rendered else '?'}options={options}"
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
