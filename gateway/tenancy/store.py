"""The SQL store: tenants, API keys and the audit log (SQLAlchemy 2 Core).

One schema for SQLite (the default, one file) and PostgreSQL (at scale); the schema itself
is created and upgraded only by the Alembic migrations in ``migrations/`` (``Store.migrate``,
``isogate migrate``). The ``Table`` objects here mirror the latest migration.

Why a *sync* engine, called through ``asyncio.to_thread`` by the async parts:

- The hot path never touches the database: authentication is served from an in-memory
  cache (``gateway.tenancy.auth``) and audit writes are batched off the request path
  (``gateway.tenancy.audit``), so one thread hop per cache miss or per batch of hundreds of events
  costs nothing that matters.
- SQLAlchemy's asyncio layer needs greenlet plus one async driver per database (aiosqlite,
  asyncpg/psycopg-async), with different failure modes; the sync drivers (the stdlib
  ``sqlite3`` and psycopg 3) are what Alembic and the CLI use anyway, so one code path
  serves the gateway, the CLI, the migrations and the bench.

Methods of ``Store`` are blocking; call them from a thread in async code. The one exception
is ``SQLiteAuditWriter``, which the audit log calls from the event loop, in bounded slices.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import operator
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    and_,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

if TYPE_CHECKING:  # imported where used: only migrations and PostgreSQL need them
    import psycopg
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"

ADMIN_TENANT_ID = "__admin__"
KEY_PREFIX = "sk-iso-"

OUTCOMES = (
    "served",
    "rejected",
    "rate_limited",
    "verification_failed",
    "upstream_error",
    "client_cancelled",
)


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps are UTC everywhere: ``timestamptz`` in PostgreSQL; in SQLite naive UTC text,
    whose lexical order is time order. Always handed back timezone-aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use a UTC-aware datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("disabled", Boolean, nullable=False, default=False),
    Column("created_at", UTCDateTime, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(40), primary_key=True),  # public key id, "key_..."
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    # SHA-256 of the raw key, hex. The raw key is never stored.
    Column("key_hash", String(64), nullable=False),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
    # The models the key may call, narrowing its tenant's (a JSON list); NULL: the tenant's.
    Column("models", Text, nullable=True),
    Index("ix_api_keys_tenant_id", "tenant_id"),
    Index("uq_api_keys_key_hash", "key_hash", unique=True),
)

audit_events = Table(
    "audit_events",
    metadata,
    # Insertion order (spool replay keeps it); not exposed, queries order by time.
    Column(
        "seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("generation_id", String(100), nullable=False),
    Column("tenant_id", String(64), nullable=False),
    Column("key_id", String(40)),
    Column("model", String(200)),
    Column("outcome", String(32), nullable=False),
    Column("status", Integer, nullable=False),
    Column("code", String(100)),
    Column("prefill_worker", String(300)),
    Column("decode_worker", String(300)),
    Column("pool", String(100)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("stream", Boolean, nullable=False),
    Column("latency_ms", Float, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("detail", Text),
    Column("policy_model", String(200)),
    Index("uq_audit_generation_id", "generation_id", unique=True),
    Index("ix_audit_tenant_time", "tenant_id", "created_at", "generation_id"),
    Index("ix_audit_time", "created_at", "generation_id"),
    Index("ix_audit_tenant_outcome_time", "tenant_id", "outcome", "created_at", "generation_id"),
)

AUDIT_COLUMNS = (
    "generation_id",
    "tenant_id",
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
)


_PG_ARRAY_TYPES = {
    "status": "integer",
    "prompt_tokens": "integer",
    "completion_tokens": "integer",
    "stream": "boolean",
    "latency_ms": "double precision",
    "created_at": "timestamptz",
}
_PG_UNNEST_INSERT = (
    f"INSERT INTO audit_events ({', '.join(AUDIT_COLUMNS)}) "
    f"SELECT {', '.join(AUDIT_COLUMNS)} FROM unnest("
    + ", ".join(f"%s::{_PG_ARRAY_TYPES.get(name, 'text')}[]" for name in AUDIT_COLUMNS)
    + f") WITH ORDINALITY AS incoming({', '.join(AUDIT_COLUMNS)}, ordinal) "
    "ORDER BY ordinal ON CONFLICT (generation_id) DO NOTHING"
)


# SQLite: INSERTs of positional values, bound by the driver; SQLAlchemy's compiled insert ran a
# bind processor per value in Python (~35 µs per event more). Whole slices go in one multi-row
# statement, the rest row by row through one prepared statement: two statement texts in all, so
# the driver's statement cache always hits. A text per slice length missed it whenever a batch
# came in a length not seen yet, and preparing a statement of tens of rows costs more than
# inserting them.
_SQLITE_ROWS_PER_INSERT = 64  # x 17 columns, well under SQLite's 32,766 variables


def _sqlite_audit_insert(rows: int) -> str:
    values = "(" + ", ".join("?" for _ in AUDIT_COLUMNS) + ")"
    return (
        f"INSERT INTO audit_events ({', '.join(AUDIT_COLUMNS)}) "
        f"VALUES {', '.join([values] * rows)} "
        "ON CONFLICT (generation_id) DO NOTHING"
    )


_SQLITE_AUDIT_INSERT_SLICE = _sqlite_audit_insert(_SQLITE_ROWS_PER_INSERT)
_SQLITE_AUDIT_INSERT_ROW = _sqlite_audit_insert(1)


_CREATED_AT = AUDIT_COLUMNS.index("created_at")
_STREAM = AUDIT_COLUMNS.index("stream")
# (index in AUDIT_COLUMNS, length) of every bounded string column.
_AUDIT_STRING_LIMITS = tuple(
    (AUDIT_COLUMNS.index(column.name), column.type.length)
    for column in audit_events.columns
    if isinstance(column.type, String) and column.type.length and column.name in AUDIT_COLUMNS
)
_STRINGS_OF = operator.itemgetter(*(index for index, _ in _AUDIT_STRING_LIMITS))
_STRING_LIMITS = tuple(limit for _, limit in _AUDIT_STRING_LIMITS)


AuditValues = Sequence[Any]
"""One audit row as the log writes it: its values in ``AUDIT_COLUMNS`` order (not a dict, which
every event would build and the insert read back by name)."""


def audit_values(row: Mapping[str, Any]) -> list[Any]:
    """A row given by column name (a spooled batch, a caller's) in ``AUDIT_COLUMNS`` order.
    ``.get``: rows spooled by an older version lack the columns added since (the pool)."""
    return list(map(row.get, AUDIT_COLUMNS))


def audit_row(values: AuditValues) -> dict[str, Any]:
    """A row's values by column name (what the spool and the quarantine write)."""
    return dict(zip(AUDIT_COLUMNS, values, strict=True))


def _fitted(values: AuditValues) -> list[Any]:
    """A copy of a row's values, strings longer than their column (a client's 10 kB model name)
    cut to fit, so a value the request path did not bound cannot make a batch unwritable;
    ``created_at`` checked to be a UTC-aware datetime."""
    fitted = list(values)
    # Whether any string is too long, by C calls alone (None reads as "None", shorter than
    # every limit): the loop, a dozen steps of the interpreter per row, only for one that is.
    if any(map(operator.gt, map(len, map(str, _STRINGS_OF(fitted))), _STRING_LIMITS)):
        for index, limit in _AUDIT_STRING_LIMITS:
            value = fitted[index]
            if isinstance(value, str) and len(value) > limit:
                fitted[index] = value[: limit - 1] + "…"
    moment = fitted[_CREATED_AT]
    if not isinstance(moment, datetime) or moment.tzinfo is None:
        raise ValueError("created_at must be a UTC-aware datetime")
    return fitted


def _sqlite_audit_params(values: AuditValues) -> list[Any]:
    """One row as the driver binds it, stored exactly as ``UTCDateTime`` and ``Boolean`` store it
    (naive UTC text, microseconds always written so text order is time order; 0/1)."""
    params = _fitted(values)
    params[_CREATED_AT] = (
        params[_CREATED_AT].astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
    )
    params[_STREAM] = 1 if params[_STREAM] else 0
    return params


def _psycopg_connection(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn`` (on PostgreSQL the driver is always psycopg)."""
    return cast("psycopg.Connection[Any]", conn.connection.driver_connection)


def _insert_sqlite_audit_rows(conn: Connection, rows: Sequence[AuditValues]) -> None:
    params = [_sqlite_audit_params(row) for row in rows]
    whole = len(params) - len(params) % _SQLITE_ROWS_PER_INSERT
    for start in range(0, whole, _SQLITE_ROWS_PER_INSERT):
        chunk = params[start : start + _SQLITE_ROWS_PER_INSERT]
        conn.exec_driver_sql(
            _SQLITE_AUDIT_INSERT_SLICE, tuple(itertools.chain.from_iterable(chunk))
        )
    if whole < len(params):  # executemany: one statement, prepared once, stepped per row
        conn.exec_driver_sql(_SQLITE_AUDIT_INSERT_ROW, [tuple(row) for row in params[whole:]])


@contextlib.contextmanager
def _audit_refusals() -> Iterator[None]:
    """Tell a database that refused the rows (``AuditRowsRefused``) from one that could not be
    written (the exception as it is: an outage)."""
    try:
        yield
    except (IntegrityError, DataError, ValueError, TypeError, KeyError) as exc:
        raise AuditRowsRefused(str(exc)) from exc
    except StatementError as exc:
        if isinstance(exc, DBAPIError):
            raise  # the database could not be reached or written: an outage
        raise AuditRowsRefused(str(exc)) from exc  # a value could not even be bound


class SQLiteAuditWriter:
    """Audit inserts made on the event loop's thread, on one SQLite connection of their own.

    Why not from a worker thread like every other store call: measured in process (the bench's
    instant backends, 16 in flight), the same batched insert costs ~8 µs of CPU per event on the
    loop's thread and ~45 µs from a worker thread, which trades the GIL with the loop at every
    statement; it was the largest single cost of a request. What keeps the loop responsive:
    callers insert at most ``_SQLITE_ROWS_PER_INSERT`` rows per call (~0.5 ms); this connection
    waits at most 20 ms for another process's write lock (the audit log then waits for the lock
    from a thread, through ``Store.insert_audit_values``); and it never checkpoints the WAL (a
    checkpoint copies and fsyncs megabytes): ``checkpoint`` does that, from a thread, on a
    pooled connection.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None

    def insert(self, rows: Sequence[AuditValues]) -> None:
        """As ``Store.insert_audit_values``; raises ``AuditRowsRefused`` or the outage."""
        if not rows:
            return
        with _audit_refusals():
            connection = self._connect()
            try:
                with connection.begin():
                    _insert_sqlite_audit_rows(connection, rows)
            except DBAPIError:
                self.close()  # whatever broke, the next insert starts on a fresh connection
                raise

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (blocking: call it from a thread)."""
        with self._engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        if self._connection is not None:
            # Discarded, not pooled: its short busy timeout must not pass on to other callers.
            self._connection.invalidate()
            self._connection.close()
            self._connection = None

    def _connect(self) -> Connection:
        if self._connection is None:
            connection = self._engine.connect()
            connection.exec_driver_sql("PRAGMA busy_timeout = 20")
            connection.exec_driver_sql("PRAGMA wal_autocheckpoint = 0")
            connection.commit()
            self._connection = connection
        return self._connection


class AuditRowsRefused(Exception):
    """The database answered and refused these audit rows (a bad value): not an outage."""


class StoreConflict(Exception):
    """A row with that id already exists."""


class StoreNotFound(Exception):
    """No row with that id."""


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    name: str
    disabled: bool
    created_at: datetime

    def to_json(self) -> dict[str, object]:
        return {
            "object": "tenant",
            "id": self.id,
            "name": self.name,
            "disabled": self.disabled,
            "created_at": rfc3339(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    tenant_id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    # The models it may call, within its tenant's; None: its tenant's.
    models: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "object": "api_key",
            "id": self.id,
            "tenant": self.tenant_id,
            "name": self.name,
            "created_at": rfc3339(self.created_at),
            "revoked_at": rfc3339(self.revoked_at) if self.revoked_at else None,
            "models": None if self.models is None else list(self.models),
        }


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """What authentication needs to know about a presented key."""

    key_id: str
    tenant_id: str
    revoked: bool
    tenant_disabled: bool
    models: tuple[str, ...] | None = None  # the key's narrowing of its tenant's models


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """Filters of an audit query. ``tenant_id`` None means every tenant (admin only)."""

    tenant_id: str | None = None
    since: datetime | None = None  # inclusive
    until: datetime | None = None  # exclusive
    outcome: str | None = None
    model: str | None = None
    generation_id: str | None = None
    limit: int = 100
    # Keyset position: return events strictly older than (created_at, generation_id).
    after: tuple[datetime, str] | None = None


def hash_key(raw_key: str) -> str:
    """Keys are 256-bit random tokens, so a plain SHA-256 is a sound one-way hash for them."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


def new_raw_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def encode_cursor(created_at: datetime, generation_id: str) -> str:
    payload = orjson.dumps([rfc3339(created_at), generation_id])
    return base64.urlsafe_b64encode(payload).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError for anything that is not a cursor this module made."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        moment, generation_id = orjson.loads(base64.urlsafe_b64decode(padded.encode()))
        parsed = datetime.fromisoformat(moment)
    except Exception as exc:  # any malformed cursor is the same client error
        raise ValueError("malformed cursor") from exc
    if not isinstance(generation_id, str) or parsed.tzinfo is None:
        raise ValueError("malformed cursor")
    return parsed, generation_id


class Store:
    def __init__(self, engine: Engine, reader: Engine | None = None):
        self.engine = engine
        # Single-statement reads (auth lookups, audit queries) need no transaction; on
        # PostgreSQL an autocommit engine saves the BEGIN/ROLLBACK round trips of each one.
        self.reader = reader or engine
        self.dialect = engine.dialect.name

    # -- schema -----------------------------------------------------------------------

    def migrate(self, revision: str = "head") -> None:
        """Apply the Alembic migrations up to ``revision`` (idempotent)."""
        from alembic import command

        command.upgrade(alembic_config(self.engine), revision)

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def dispose(self) -> None:
        self.engine.dispose()
        if self.reader is not self.engine:
            self.reader.dispose()

    # -- tenants ----------------------------------------------------------------------

    def create_tenant(self, tenant_id: str, name: str | None = None) -> TenantRecord:
        record = TenantRecord(tenant_id, name or tenant_id, False, _now())
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(tenants).values(
                        id=record.id, name=record.name, disabled=False, created_at=record.created_at
                    )
                )
        except IntegrityError as exc:
            raise StoreConflict(f"tenant {tenant_id!r} already exists") from exc
        return record

    def get_tenant(self, tenant_id: str) -> TenantRecord:
        with self.reader.connect() as conn:
            row = conn.execute(select(tenants).where(tenants.c.id == tenant_id)).one_or_none()
        if row is None:
            raise StoreNotFound(f"no tenant {tenant_id!r}")
        return TenantRecord(row.id, row.name, row.disabled, row.created_at)

    def list_tenants(self) -> list[TenantRecord]:
        with self.reader.connect() as conn:
            rows = conn.execute(select(tenants).order_by(tenants.c.id)).all()
        return [TenantRecord(r.id, r.name, r.disabled, r.created_at) for r in rows]

    def set_tenant_disabled(self, tenant_id: str, disabled: bool) -> TenantRecord:
        with self.engine.begin() as conn:
            result = conn.execute(
                update(tenants).where(tenants.c.id == tenant_id).values(disabled=disabled)
            )
        if result.rowcount == 0:
            raise StoreNotFound(f"no tenant {tenant_id!r}")
        return self.get_tenant(tenant_id)

    # -- keys -------------------------------------------------------------------------

    def create_key(
        self, tenant_id: str, name: str | None = None, models: Sequence[str] | None = None
    ) -> tuple[str, KeyRecord]:
        """Returns (raw key, record). The raw key exists only in this return value. ``models``:
        the only models the key may call (within its tenant's); fixed for the key's life."""
        raw_key = new_raw_key()
        narrowed = None if models is None else tuple(models)
        record = KeyRecord(new_key_id(), tenant_id, name or "", _now(), None, narrowed)
        with self.engine.begin() as conn:
            exists = conn.execute(select(tenants.c.id).where(tenants.c.id == tenant_id)).first()
            if exists is None:
                raise StoreNotFound(f"no tenant {tenant_id!r}")
            conn.execute(
                insert(api_keys).values(
                    id=record.id,
                    tenant_id=tenant_id,
                    key_hash=hash_key(raw_key),
                    name=record.name,
                    created_at=record.created_at,
                    revoked_at=None,
                    # Only when set: a key of its tenant's models is the row it always was.
                    **({} if narrowed is None else {"models": orjson.dumps(narrowed).decode()}),
                )
            )
        return raw_key, record

    def list_keys(self, tenant_id: str | None = None) -> list[KeyRecord]:
        query = select(api_keys).order_by(
            api_keys.c.tenant_id, api_keys.c.created_at, api_keys.c.id
        )
        if tenant_id is not None:
            query = query.where(api_keys.c.tenant_id == tenant_id)
        with self.reader.connect() as conn:
            rows = conn.execute(query).all()
        return [_key_record(r) for r in rows]

    def get_key(self, key_id: str) -> KeyRecord:
        with self.reader.connect() as conn:
            r = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).one_or_none()
        if r is None:
            raise StoreNotFound(f"no key {key_id!r}")
        return _key_record(r)

    def revoke_key(self, key_id: str) -> KeyRecord:
        """Revoking an already revoked key keeps its first revocation time."""
        with self.engine.begin() as conn:
            conn.execute(
                update(api_keys)
                .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=_now())
            )
        return self.get_key(key_id)

    def lookup_key(self, key_hash: str) -> KeyLookup | None:
        query = (
            select(
                api_keys.c.id,
                api_keys.c.tenant_id,
                api_keys.c.revoked_at,
                api_keys.c.models,
                tenants.c.disabled,
            )
            .join(tenants, tenants.c.id == api_keys.c.tenant_id)
            .where(api_keys.c.key_hash == key_hash)
        )
        with self.reader.connect() as conn:
            row = conn.execute(query).one_or_none()
        if row is None:
            return None
        return KeyLookup(
            row.id,
            row.tenant_id,
            row.revoked_at is not None,
            bool(row.disabled),
            _key_models(row.models),
        )

    # -- audit ------------------------------------------------------------------------

    def insert_audit_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """``insert_audit_values`` for rows given by column name."""
        self.insert_audit_values([audit_values(row) for row in rows])

    def insert_audit_values(self, rows: Sequence[AuditValues]) -> None:
        """Insert in the given order, in one transaction; rows whose generation_id is already
        stored are skipped, so replaying a batch is harmless.

        Strings longer than their column are cut to fit (``_fitted``). Raises
        ``AuditRowsRefused`` when the database answered and refused the rows themselves
        (e.g. a missing tenant id); any other exception means it could not be written to.
        """
        if not rows:
            return
        with _audit_refusals():
            if self.dialect == "postgresql":
                self._insert_audit_rows_postgres(rows)
                return
            with self.engine.begin() as conn:
                _insert_sqlite_audit_rows(conn, rows)

    def sqlite_audit_writer(self) -> SQLiteAuditWriter | None:
        """The audit log's own connection for inserts from the event loop (SQLite only)."""
        return SQLiteAuditWriter(self.engine) if self.dialect == "sqlite" else None

    def _insert_audit_rows_postgres(self, rows: Sequence[AuditValues]) -> None:
        # One statement per batch: every column travels as one array parameter and unnest
        # turns them back into rows. One round trip and one plan, where executemany costs a
        # statement per row (about twice the client CPU per event).
        import psycopg

        columns = [list(column) for column in zip(*(_fitted(row) for row in rows), strict=True)]
        try:
            with self.engine.begin() as conn, _psycopg_connection(conn).cursor() as cursor:
                cursor.execute(_PG_UNNEST_INSERT, columns)
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:
            raise AuditRowsRefused(str(exc)) from exc

    def query_audit(self, query: AuditQuery) -> tuple[list[dict[str, Any]], str | None]:
        """Newest first; returns (rows, next_cursor or None)."""
        t = audit_events
        conditions = []
        if query.tenant_id is not None:
            conditions.append(t.c.tenant_id == query.tenant_id)
        if query.since is not None:
            conditions.append(t.c.created_at >= query.since)
        if query.until is not None:
            conditions.append(t.c.created_at < query.until)
        if query.outcome is not None:
            conditions.append(t.c.outcome == query.outcome)
        if query.model is not None:
            conditions.append(t.c.model == query.model)
        if query.generation_id is not None:
            conditions.append(t.c.generation_id == query.generation_id)
        if query.after is not None:
            moment, generation_id = query.after
            conditions.append(
                or_(
                    t.c.created_at < moment,
                    and_(t.c.created_at == moment, t.c.generation_id < generation_id),
                )
            )
        statement = (
            select(*(t.c[name] for name in AUDIT_COLUMNS))
            .where(*conditions)
            .order_by(t.c.created_at.desc(), t.c.generation_id.desc())
            .limit(query.limit + 1)
        )
        with self.reader.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(statement)]
        next_cursor = None
        if len(rows) > query.limit:
            rows = rows[: query.limit]
            last = rows[-1]
            next_cursor = encode_cursor(last["created_at"], last["generation_id"])
        return rows, next_cursor

    def count_audit(self) -> int:
        with self.reader.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(audit_events)).scalar_one())

    def token_usage(self, tenant_id: str, since: datetime, policy_model: str | None = None) -> int:
        """The prompt + completion tokens of the tenant's generations since ``since`` (on one
        model, where given): the durable record its token budgets are rebuilt from. A request
        counts once it generated (its completion tokens are recorded), however it ended."""
        t = audit_events
        conditions = [
            t.c.tenant_id == tenant_id,
            t.c.created_at >= since,
            t.c.completion_tokens.is_not(None),
        ]
        if policy_model is not None:
            conditions.append(t.c.policy_model == policy_model)
        total = func.coalesce(
            func.sum(func.coalesce(t.c.prompt_tokens, 0) + t.c.completion_tokens), 0
        )
        with self.reader.connect() as conn:
            return int(conn.execute(select(total).where(*conditions)).scalar_one())


def _key_models(stored: str | None) -> tuple[str, ...] | None:
    return None if stored is None else tuple(orjson.loads(stored))


def _key_record(row: Any) -> KeyRecord:
    return KeyRecord(
        row.id, row.tenant_id, row.name, row.created_at, row.revoked_at, _key_models(row.models)
    )


def audit_row_json(row: dict[str, Any], *, admin: bool) -> dict[str, object]:
    """The public shape of one audit event. Worker URLs are internal addresses: only the admin
    key sees them; a tenant sees the pool that served it."""
    return {
        "object": "audit.event",
        "id": row["generation_id"],
        "generation_id": row["generation_id"],
        "tenant": row["tenant_id"],
        "key_id": row["key_id"],
        "model": row["model"],
        "outcome": row["outcome"],
        "status": row["status"],
        "code": row["code"],
        "prefill_worker": row["prefill_worker"] if admin else None,
        "decode_worker": row["decode_worker"] if admin else None,
        "pool": row["pool"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "stream": bool(row["stream"]),
        "latency_ms": row["latency_ms"],
        "created_at": rfc3339(row["created_at"]),
        # Why a model was not found (absent, or not the tenant's) is the admin's to read: a
        # tenant told which would learn that a model it may not use exists.
        "detail": row["detail"] if admin or row["code"] != "model_not_found" else None,
        # Where ``model`` is an alias, the model that served it.
        "policy_model": row.get("policy_model"),
    }


def create_store(database_url: str, *, migrate: bool = False, busy_timeout_s: float = 5.0) -> Store:
    """An engine for ``database_url`` (SQLite file or PostgreSQL via psycopg 3).

    ``migrate=True`` also applies the migrations (what a single-node SQLite deployment wants
    at start); a PostgreSQL deployment runs ``isogate migrate`` once instead.
    ``busy_timeout_s``: how long an SQLite write waits for another process's lock before
    failing (the audit log then spools); for PostgreSQL, the connect timeout.
    """
    url = make_url(normalize_url(database_url))
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            private_file(Path(url.database))
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s})
        event.listen(engine, "connect", _sqlite_on_connect)
        reader = None
    elif url.get_backend_name() == "postgresql":
        # Fail fast while the database is down: the audit log spools instead of waiting.
        connect_args = {"connect_timeout": max(1, round(busy_timeout_s))}
        engine = create_engine(
            url, pool_size=5, max_overflow=5, pool_pre_ping=True, connect_args=connect_args
        )
        # No pre-ping for reads: a read on a connection that died fails once (its caller
        # copes: auth serves recently valid keys, the API answers 503) and the pool is reset.
        reader = create_engine(
            url,
            pool_size=5,
            max_overflow=10,
            isolation_level="AUTOCOMMIT",
            connect_args=connect_args,
        )
    else:
        raise ValueError(
            f"unsupported database URL {database_url!r}: use sqlite:// or postgresql://"
        )
    store = Store(engine, reader)
    if migrate:
        store.migrate()
    return store


def private_file(path: Path) -> None:
    """Create ``path`` (and its directory) readable by this user only, or make it so: the
    store holds every tenant's audit events and key hashes. SQLite gives its WAL and shared
    memory files the database file's permissions."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)  # an existing file keeps its mode on open


def normalize_url(database_url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here (not psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix) :]
    return database_url


def head_revision() -> str | None:
    """The newest migration's revision id (None only if there were no migrations)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return ScriptDirectory.from_config(config).get_current_head()


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py uses this engine rather than building its own from a URL (keeps connect options).
    config.attributes["engine"] = engine
    return config


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL: readers (audit queries) do not block the batched writer, and vice versa.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _now() -> datetime:
    return datetime.now(UTC)
