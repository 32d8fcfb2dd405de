"""Stored responses (the Responses API's ``store``): a tenant's data, readable by that tenant
only, kept for the tenant's retention period.

Every read and delete names the tenant in its WHERE clause, beside the id and the expiry:
another tenant's response is not fetched and then refused, it is never fetched, so it cannot
be told from a missing one (same query, same empty result, same 404). A response past its
``expires_at`` is gone for every read at once; ``sweep`` deletes the rows later, in bounded
batches (``run_sweeper``, one of the gateway's background tasks).

A row holds the Response object as it was answered, the request's own input items (what
``input_items`` lists), and the conversation a follow-up continues (``context``: the earlier
conversation, this input and this output), so chaining reads one row, and deleting one
response never changes what another one answers or continues.

Methods are blocking (SQLAlchemy Core on the store's engines, as ``gateway.tenancy.store``);
call them from a thread in async code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import Column, Index, String, Table, Text, delete, func, insert, select

from gateway.tenancy.store import Store, UTCDateTime, metadata

log = logging.getLogger("isogate.responses")

stored_responses = Table(
    "stored_responses",
    metadata,
    Column("id", String(100), primary_key=True),  # the response's id: its generation ID
    Column("tenant_id", String(64), nullable=False),
    Column("model", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("response", Text, nullable=False),  # the Response object, JSON
    Column("input_items", Text, nullable=False),  # this request's input items, JSON list
    Column("context", Text, nullable=False),  # the conversation a follow-up continues
    Index("ix_stored_responses_tenant", "tenant_id", "created_at"),
    Index("ix_stored_responses_expiry", "expires_at"),
)

# Rows one sweep statement deletes: a bounded transaction, however many expired at once.
SWEEP_BATCH = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    tenant_id: str
    model: str
    created_at: datetime
    expires_at: datetime
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def save(self, record: StoredResponse) -> None:
        with self._store.engine.begin() as conn:
            conn.execute(
                insert(stored_responses).values(
                    id=record.id,
                    tenant_id=record.tenant_id,
                    model=record.model,
                    created_at=record.created_at,
                    expires_at=record.expires_at,
                    response=orjson.dumps(record.response).decode(),
                    input_items=orjson.dumps(record.input_items).decode(),
                    context=orjson.dumps(record.context).decode(),
                )
            )

    def _read_json(
        self, column: Column[str], tenant_id: str, response_id: str, now: datetime | None
    ) -> str | None:
        t = stored_responses
        query = select(column).where(
            t.c.id == response_id, t.c.tenant_id == tenant_id, t.c.expires_at > (now or _now())
        )
        with self._store.reader.connect() as conn:
            value: str | None = conn.execute(query).scalar_one_or_none()
        return value

    def _read(
        self, column: Column[str], tenant_id: str, response_id: str, now: datetime | None
    ) -> Any | None:
        value = self._read_json(column, tenant_id, response_id, now)
        return None if value is None else orjson.loads(value)

    def response_json(
        self, tenant_id: str, response_id: str, now: datetime | None = None
    ) -> bytes | None:
        """The tenant's response as answered, as the JSON it was stored as (never parsed: with
        log probabilities it runs to megabytes, and parsing and writing it again held the loop
        for tens of milliseconds at every read); None if it has none of that id (any more)."""
        found = self._read_json(stored_responses.c.response, tenant_id, response_id, now)
        return None if found is None else found.encode()

    def input_items(
        self, tenant_id: str, response_id: str, now: datetime | None = None
    ) -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] | None = self._read(
            stored_responses.c.input_items, tenant_id, response_id, now
        )
        return found

    def context(
        self, tenant_id: str, response_id: str, now: datetime | None = None
    ) -> list[dict[str, Any]] | None:
        """What a follow-up of this response continues."""
        found: list[dict[str, Any]] | None = self._read(
            stored_responses.c.context, tenant_id, response_id, now
        )
        return found

    def delete(self, tenant_id: str, response_id: str, now: datetime | None = None) -> bool:
        """Whether the tenant had that response (an expired one is gone already: False)."""
        t = stored_responses
        with self._store.engine.begin() as conn:
            result = conn.execute(
                delete(t).where(
                    t.c.id == response_id,
                    t.c.tenant_id == tenant_id,
                    t.c.expires_at > (now or _now()),
                )
            )
        return bool(result.rowcount)

    def sweep(self, now: datetime | None = None, batch: int = SWEEP_BATCH) -> int:
        """Delete every expired response, ``batch`` rows per transaction; how many."""
        t = stored_responses
        moment = now or _now()
        removed = 0
        while True:
            expired = select(t.c.id).where(t.c.expires_at <= moment).limit(batch)
            with self._store.engine.begin() as conn:
                count = conn.execute(delete(t).where(t.c.id.in_(expired.scalar_subquery())))
            removed += count.rowcount
            if count.rowcount < batch:
                return removed

    def counts(self, now: datetime | None = None) -> dict[str, int]:
        """Each tenant's stored responses that have not expired."""
        t = stored_responses
        query = (
            select(t.c.tenant_id, func.count())
            .where(t.c.expires_at > (now or _now()))
            .group_by(t.c.tenant_id)
        )
        with self._store.reader.connect() as conn:
            return {tenant: int(count) for tenant, count in conn.execute(query)}

    async def run_sweeper(
        self, interval_s: float, on_counts: Callable[[dict[str, int]], None] | None = None
    ) -> None:
        """Sweep every ``interval_s`` until cancelled (a failed sweep is logged and retried at
        the next); ``on_counts`` is handed each tenant's count after each sweep."""
        while True:
            try:
                removed = await asyncio.to_thread(self.sweep)
                if removed:
                    log.info("swept expired stored responses", extra={"removed": removed})
                if on_counts is not None:
                    on_counts(await asyncio.to_thread(self.counts))
            except Exception:
                log.exception("sweeping stored responses failed; trying again later")
            await asyncio.sleep(interval_s)


def _now() -> datetime:
    return datetime.now(UTC)
