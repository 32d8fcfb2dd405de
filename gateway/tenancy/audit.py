"""The audit log: one event per request, whatever its outcome, written in batches.

``record`` only appends to an in-memory queue (never blocks, never raises). A writer task
inserts the queue in batches of ``settings.audit_batch_size`` every
``settings.audit_flush_interval_s`` while events arrive, and sleeps without a timer while there
is nothing to write (the first event recorded wakes it): into PostgreSQL from a thread (the store is
synchronous); into SQLite from the event loop itself, 64 rows per turn, on a connection that
never waits long for a lock nor checkpoints (``gateway.tenancy.store.SQLiteAuditWriter`` says why).

While the database cannot be written, batches go to the spool directory instead: one
JSON-lines file per batch, written to a temporary name, fsynced and renamed, so a file is
either whole or absent. Once a spool file exists, every later batch is spooled behind it
(never written around it), and the writer retries the database with a backoff; when it
answers, the files are replayed oldest first, each deleted only after its rows committed.
Replay is idempotent (``generation_id`` is unique and inserts skip known ids), so a crash
between commit and delete duplicates nothing. Spool files left by a previous run are
replayed at start. ``close`` drains the queue into the database, or into the spool while
the database is down: after it returns, every recorded event is on durable storage.

A database that answers but refuses a batch (a bad value, e.g. a missing tenant id from a
bug upstream) is not an outage: the batch is written row by row, the good rows in order,
and each refused row is kept in ``<spool>/refused/refused.jsonl`` with the reason (counted
in ``AuditLog.refused``), so one bad event never holds back the ones after it. Strings too
long for their column are cut to fit by the store.

What a hard kill (SIGKILL, power loss) loses: the events still in memory, at most one
flush interval's worth.

One spool directory belongs to one process: the log takes an exclusive lock on it and
falls back to a ``pid-<pid>`` subdirectory when another live process holds it; directories
of dead processes are adopted and replayed at start.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import operator
import os
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config.settings import Settings
from gateway.tenancy.store import (
    AUDIT_COLUMNS,
    AuditRowsRefused,
    AuditValues,
    audit_row,
    audit_values,
)

if TYPE_CHECKING:
    from gateway.tenancy.store import Store

log = logging.getLogger("isogate.audit")

_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 5.0
# SQLite: rows inserted per turn of the event loop (~0.5 ms), and how often the WAL is
# checkpointed from a thread (the loop's own connection never does it).
_SQLITE_SLICE_ROWS = 64
_CHECKPOINT_EVERY_ROWS = 5_000
_CHECKPOINT_EVERY_S = 10.0


@dataclass(slots=True, kw_only=True)
class AuditEvent:
    generation_id: str
    tenant_id: str
    key_id: str | None
    model: str | None
    # "served" | "rejected" | "rate_limited" | "verification_failed" | "upstream_error"
    # | "client_cancelled"
    outcome: str
    status: int  # HTTP status the client got
    code: str | None  # error code for non-served outcomes
    prefill_worker: str | None
    decode_worker: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    stream: bool
    latency_ms: float
    created_at: datetime  # UTC, request start
    detail: str | None = None  # short reason for failures; never prompt or completion text
    pool: str | None = None  # the worker pool that served it (what its tenant is shown)
    # The model of models.yaml that ``model`` (the name the client used) resolved to: differs
    # from it where the client used an alias.
    policy_model: str | None = None

    def values(self) -> AuditValues:
        """The event's values in ``AUDIT_COLUMNS`` order: the row as the log writes it."""
        return _AUDIT_VALUES(self)

    def row(self) -> dict[str, Any]:
        """The event by column name."""
        return audit_row(_AUDIT_VALUES(self))


# Every column's value in one call (a getattr per column cost a call each, on every request).
_AUDIT_VALUES = operator.attrgetter(*AUDIT_COLUMNS)


class AuditSpool:
    """Ordered, durable batches on local disk: one whole file per batch."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock_file: int | None = None
        self._next_number = 0
        # Batch files in the directory, counted rather than listed: the writer asks after every
        # flush, and a directory listing each time was most of an idle gateway's CPU. Only
        # the process holding the directory's lock adds or removes files, so the count holds.
        self.pending = 0

    def open(self) -> list[Path]:
        """Lock a directory for this process; return the orphaned directories to adopt."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        if not self._try_lock(self.directory):
            own = self.directory / f"pid-{os.getpid()}"
            own.mkdir(mode=0o700, exist_ok=True)
            if not self._try_lock(own):
                raise RuntimeError(f"audit spool {own} is locked by another process")
            orphans: list[Path] = []
            self.directory = own
        else:
            orphans = [
                sub
                for sub in sorted(self.directory.glob("pid-*"))
                if sub.is_dir() and _unlocked(sub)
            ]
        existing = self.files()
        self._next_number = int(existing[-1].stem) + 1 if existing else 0
        self.pending = len(existing)
        return orphans

    def close(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("[0-9]*.jsonl"))

    def append(self, rows: list[AuditValues]) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / f"{self._next_number:016d}.jsonl"
        self._next_number += 1
        temporary = path.with_suffix(".tmp")
        # Readable by this user only: events name tenants, keys and workers.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(descriptor, "wb") as handle:
            # default=str: whatever a buggy caller put in an event, the spool can hold it (the
            # database may still refuse it at replay; then it is set aside, see _insert_each).
            handle.write(
                b"".join(orjson.dumps(audit_row(row), default=str) + b"\n" for row in rows)
            )
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(temporary, path)
        self.pending += 1
        _fsync_directory(self.directory)

    def remove(self, path: Path) -> None:
        """A batch file that is in the database now."""
        path.unlink()
        self.pending -= 1

    def adopt(self, orphan: Path) -> None:
        """Move a dead process's spool files behind ours, keeping their order."""
        for path in sorted(orphan.glob("[0-9]*.jsonl")):
            target = self.directory / f"{self._next_number:016d}.jsonl"
            self._next_number += 1
            os.rename(path, target)
            self.pending += 1
        for leftover in orphan.iterdir():
            leftover.unlink()
        orphan.rmdir()
        _fsync_directory(self.directory)

    @staticmethod
    def read(path: Path) -> list[AuditValues]:
        rows: list[AuditValues] = []
        for line in path.read_bytes().splitlines():
            if line:
                row = orjson.loads(line)
                row["created_at"] = datetime.fromisoformat(row["created_at"])
                rows.append(audit_values(row))
        return rows

    def _try_lock(self, directory: Path) -> bool:
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_file = fd
        return True


class AuditLog:
    def __init__(self, store: Store, settings: Settings):
        self._store = store
        # SQLite is written from the loop itself, in slices (see SQLiteAuditWriter); PostgreSQL
        # from a thread.
        self._sqlite = store.sqlite_audit_writer()
        self._rows_since_checkpoint = 0
        self._checkpoint_at = time.monotonic() + _CHECKPOINT_EVERY_S
        self._batch_size = max(1, settings.audit_batch_size)
        self._flush_interval_s = settings.audit_flush_interval_s
        self._spool = AuditSpool(Path(settings.audit_spool_dir))
        self._queue: deque[AuditEvent] = deque()
        self._wake = asyncio.Event()
        # The writer waits for the first event of the next batch (``_sleep_until_recorded``).
        self._asleep = False
        # One writer at a time (the task, or flush/close): the spool order depends on it.
        self._writing = asyncio.Lock()
        self._closing = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._retry_delay_s = _RETRY_MIN_S
        self.database_ok = True
        # Events the database refused (bad values), kept under quarantine_dir; not retried.
        self.refused = 0
        self.quarantine_dir = Path(settings.audit_spool_dir) / "refused"

    @property
    def queued(self) -> int:
        """Events recorded but neither in the database nor in the spool yet."""
        return len(self._queue)

    @property
    def spool_files(self) -> int:
        return self._spool.pending

    async def start(self) -> None:
        orphans = self._spool.open()
        for orphan in orphans:
            self._spool.adopt(orphan)
        if self._spool.pending:
            log.warning("audit: %d spooled batches from an earlier run to replay", self.spool_files)
        self._task = asyncio.create_task(self._run(), name="audit-writer")

    def record(self, event: AuditEvent) -> None:
        try:
            if self._closed:
                # Nothing will write the queue any more; keep the event on disk instead
                # (replayed at the next start). Rare: only a request outliving shutdown.
                self._spool.append([event.values()])
                return
            self._queue.append(event)
            if self._asleep or len(self._queue) >= self._batch_size:
                self._wake.set()
        except Exception:  # never let auditing break a request
            log.exception("audit: could not queue an event")

    async def flush(self) -> None:
        """Write everything queued so far (to the database, or the spool while it is down)."""
        await self._write(force_retry=True)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        else:
            await self._write(force_retry=True)
        self._closed = True
        self._spool.close()
        if self._sqlite is not None:
            self._sqlite.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._queue or self._spool.pending or self._closing):
                await self._sleep_until_recorded(loop)
            # A timer that sets the event, rather than ``wait_for``: that wraps the wait in a
            # new task every flush interval.
            timer = loop.call_later(self._flush_interval_s, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            self._wake.clear()
            closing = self._closing
            try:
                await self._write(force_retry=closing)
                await self._checkpoint_if_due()
            except Exception:  # the writer must survive anything, e.g. a full disk
                log.exception("audit: writer failed; retrying")
                await asyncio.sleep(_RETRY_MIN_S)
                continue
            if closing and not self._queue:
                return

    async def _sleep_until_recorded(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing queued, spooled or closing: wait for ``record`` (or ``close``) to wake the
        writer, with a timer only for a checkpoint that falls due. A timer every flush
        interval was an idle gateway's most frequent wake-up."""
        timer = None
        if self._sqlite is not None and self._rows_since_checkpoint:
            due_in = max(0.0, self._checkpoint_at - time.monotonic())
            timer = loop.call_later(due_in, self._wake.set)
        self._asleep = True
        try:
            await self._wake.wait()
        finally:
            self._asleep = False
            if timer is not None:
                timer.cancel()
        if not self._closing and len(self._queue) < self._batch_size:
            self._wake.clear()  # the batch's first event: the next ones get the interval to come

    async def _write(self, *, force_retry: bool) -> None:
        async with self._writing:
            await self._write_locked(force_retry=force_retry)

    async def _write_locked(self, *, force_retry: bool) -> None:
        if self._spool.pending and (force_retry or time.monotonic() >= self._retry_at):
            await self._replay()
        while self._queue:
            count = min(self._batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(count)]
            rows = [event.values() for event in batch]
            if self._spool.pending or not await self._insert(rows):
                await asyncio.to_thread(self._spool.append, rows)

    async def _replay(self) -> None:
        files = self._spool.files()
        while files:
            chunk: list[Path] = []
            rows: list[AuditValues] = []
            while files and (not rows or len(rows) < self._batch_size):
                path = files.pop(0)
                chunk.append(path)
                rows.extend(await asyncio.to_thread(self._spool.read, path))
            if not await self._insert(rows):
                return
            for path in chunk:
                self._spool.remove(path)
        log.warning("audit: spool replayed; database writes resumed")

    async def _insert_rows(self, rows: list[AuditValues]) -> None:
        """The one place rows reach the database; raises what the store raises."""
        if self._sqlite is None:
            await asyncio.to_thread(self._store.insert_audit_values, rows)
            return
        for start in range(0, len(rows), _SQLITE_SLICE_ROWS):
            if start:
                await asyncio.sleep(0)  # let requests run between slices
            try:
                self._sqlite.insert(rows[start : start + _SQLITE_SLICE_ROWS])
            except AuditRowsRefused:
                raise
            except Exception:
                # Most often another process's write lock (several workers on one file): wait
                # for it from a thread, with the store's full busy timeout, not on the loop. If
                # that fails too, it is an outage (the caller spools; replay skips what is in).
                await asyncio.to_thread(self._store.insert_audit_values, rows[start:])
                break
        self._rows_since_checkpoint += len(rows)

    async def _checkpoint_if_due(self) -> None:
        if self._sqlite is None or not self._rows_since_checkpoint:
            return
        if (
            self._rows_since_checkpoint < _CHECKPOINT_EVERY_ROWS
            and time.monotonic() < self._checkpoint_at
        ):
            return
        self._rows_since_checkpoint = 0
        self._checkpoint_at = time.monotonic() + _CHECKPOINT_EVERY_S
        try:
            await asyncio.to_thread(self._sqlite.checkpoint)
        except Exception as exc:  # the rows are committed (in the WAL); the next one retries
            log.warning("audit: WAL checkpoint failed (%s)", exc)

    async def _insert(self, rows: list[AuditValues]) -> bool:
        try:
            await self._insert_rows(rows)
        except AuditRowsRefused as exc:
            # Not an outage: some row is bad. Write the batch row by row so the good rows
            # go in (in order) and only the bad ones are set aside, instead of one bad row
            # holding back every later event forever.
            log.error("audit: database refused a batch (%s); writing it row by row", exc)
            return await self._insert_each(rows)
        except Exception as exc:
            self._note_outage(exc)
            return False
        self.database_ok = True
        self._retry_delay_s = _RETRY_MIN_S
        return True

    def _note_outage(self, exc: Exception) -> None:
        if self.database_ok:
            log.error(
                "audit: database write failed (%s); spooling to %s", exc, self._spool.directory
            )
        self.database_ok = False
        self._retry_at = time.monotonic() + self._retry_delay_s
        self._retry_delay_s = min(self._retry_delay_s * 2, _RETRY_MAX_S)

    async def _insert_each(self, rows: list[AuditValues]) -> bool:
        for row in rows:
            try:
                await self._insert_rows([row])
            except AuditRowsRefused as exc:
                self.refused += 1
                named = audit_row(row)
                log.error(
                    "audit: event %r refused by the database (%s); kept in %s",
                    named["generation_id"],
                    exc,
                    self.quarantine_dir,
                )
                await asyncio.to_thread(_quarantine, self.quarantine_dir, named, str(exc))
            except Exception as exc:
                # An outage in the middle: the caller spools the whole batch; the rows
                # already written are skipped on replay (generation_id is unique).
                self._note_outage(exc)
                return False
        self.database_ok = True
        return True


def _quarantine(directory: Path, row: dict[str, Any], reason: str) -> None:
    """Keep a row the database refused, with the reason, for an operator to look at."""
    directory.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps({"reason": reason, "row": row}, default=repr) + b"\n"
    with open(directory / "refused.jsonl", "ab") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def _unlocked(directory: Path) -> bool:
    lock_path = directory / ".lock"
    if not lock_path.exists():
        return True
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing releases the probe's lock
    return True


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
