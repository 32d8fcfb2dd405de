"""A request body parsed without letting one body stall every other request.

Cheap bounds come before expensive work: the size (``gateway.api.pipeline.read_body``), then the
list bounds (``protocol.check_counts``) before pydantic validates a single item. A body of at
least ``parse_off_loop_min_bytes`` is parsed and validated in a child process, after a shape
scan by msgspec (an over-long message list is refused without building a Python object per
message). Why a process, not a thread: orjson, msgspec and pydantic-core each hold the GIL for
the whole of a call, so in a thread a 60 MB body would stall the event loop just the same.

A body that large is never joined in memory either: ``read_large_body`` writes its chunks to a
file (``SpooledBody``, in ``/dev/shm`` where there is one) as they arrive, and the child reads
it there. Joining or pickling 60 MB holds the loop or the GIL for as long as copying 60 MB
takes (about 100 ms on a busy host), which is what every other request would wait.

The pool is bounded (``parse_processes``); bodies beyond it wait their turn off the loop.

A caller may give a ``check`` of the parsed request (a picklable callable raising ``APIError``),
run where it was parsed: a request refused there for what it holds (``/v1/detokenize``'s ids
past the model's context) never comes back to the loop to be unpickled whole.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Final

import msgspec

from gateway.common.errors import APIError, unavailable
from gateway.openai import protocol

log = logging.getLogger("isogate.intake")


class _Shape(msgspec.Struct):
    """What is read of a large body before it is parsed for real: the length of its lists."""

    messages: (
        Annotated[list[msgspec.Raw], msgspec.Meta(max_length=protocol.MAX_MESSAGES)] | None
    ) = None


_SHAPE = msgspec.json.Decoder(_Shape)

# (parsed request, None) or (None, the refusal as APIError's fields)
_Parsed = tuple[Any, tuple[int, str, str, str | None, str | None] | None]
# What a caller checks of a parsed request, where it was parsed: raises ``APIError`` to refuse.
Check = Callable[[Any], None]


def parse_in_child(body: bytes, schema: type[Any], check: Check | None = None) -> _Parsed:
    """Runs in a pool process: the shape scan (for a schema with a message list; a scan costs
    about a third of the parse itself), then ``protocol.parse_request``."""
    if "messages" in schema.model_fields:
        try:
            _SHAPE.decode(body)
        except msgspec.ValidationError as exc:
            if "$.messages" in str(exc) and "length" in str(exc):
                error = protocol.too_many_messages()
                return None, (error.status, error.message, error.type, error.code, error.param)
            # Any other shape (not an object, a wrong type): the real parse says what is wrong.
        except msgspec.DecodeError:
            pass  # the real parse names the error as every other body's
    try:
        return _checked(protocol.parse_request(body, schema), check), None
    except APIError as error:
        return None, (error.status, error.message, error.type, error.code, error.param)


def parse_file_in_child(path: str, schema: type[Any], check: Check | None = None) -> _Parsed:
    with open(path, "rb") as spooled:
        body = spooled.read()
    return parse_in_child(body, schema, check)


def _checked(parsed: Any, check: Check | None) -> Any:
    if check is not None:
        check(parsed)
    return parsed


class SpooledBody:
    """A large body, written to a file chunk by chunk as it arrives (0600, removed after)."""

    def __init__(self, directory: Path) -> None:
        self._fd, self.path = tempfile.mkstemp(prefix="isogate-body-", dir=directory)
        self._open = True
        self.size = 0

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]
        self.size += len(chunk)

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)

    def discard(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# /dev/shm is used only with this much room: a container's default (64 MB) is not enough.
_SPOOL_MIN_FREE_BYTES = 1 << 30


def _spool_directory() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        room = os.statvfs(shm)
        if room.f_bavail * room.f_frsize >= _SPOOL_MIN_FREE_BYTES:
            return shm
    return Path(tempfile.gettempdir())


def _warm() -> None:
    """Nothing: the first call starts the process (and its imports) before a body waits on it."""


class BodyParser:
    """Parses request bodies: small ones on the loop, large ones in a bounded process pool."""

    def __init__(self, *, off_loop_min_bytes: int, processes: int) -> None:
        # Bodies of at least this many bytes are spooled (``spool``) and parsed in a child.
        self.spill_at: Final = off_loop_min_bytes
        self._processes = processes
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["gateway.server.intake"])
        self._pool: ProcessPoolExecutor | None = None
        self._slots = asyncio.Semaphore(processes)
        self._spool_directory = _spool_directory()

    def spool(self) -> SpooledBody:
        return SpooledBody(self._spool_directory)

    def start(self) -> None:
        self._pool = ProcessPoolExecutor(self._processes, mp_context=self._context)
        self._pool.submit(_warm)

    async def parse(
        self, body: bytes | SpooledBody, schema: type[Any], check: Check | None = None
    ) -> Any:
        if isinstance(body, SpooledBody):
            body.close()
            try:
                return await self._in_child(parse_file_in_child, body.path, schema, check)
            finally:
                body.discard()
        if len(body) < self.spill_at or self._pool is None:
            return _checked(protocol.parse_request(body, schema), check)
        return await self._in_child(parse_in_child, body, schema, check)

    async def _in_child(
        self, parse: Any, body: Any, schema: type[Any], check: Check | None = None
    ) -> Any:
        if self._pool is None:
            raise unavailable("The request body parser is not running.", code="parser_unavailable")
        async with self._slots:
            pool = self._pool
            try:
                parsed, refused = await asyncio.wrap_future(pool.submit(parse, body, schema, check))
            except BrokenProcessPool:
                # A child died (killed, out of memory): a fresh pool for the next body.
                log.error("intake: a body-parsing process died; starting a new pool")
                if self._pool is pool:
                    pool.shutdown(wait=False, cancel_futures=True)
                    self.start()
                raise unavailable(
                    "The request body could not be parsed; try again.", code="parser_unavailable"
                ) from None
        if refused is not None:
            status, message, type_, code, param = refused
            raise APIError(status, message, type_, code, param)
        return parsed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> BodyParser:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
