"""A request body parsed without letting one body stall every other request.

Cheap bounds come before expensive work: the size (``gateway.pipeline.read_body``), then the
list bounds (``protocol.check_counts``) before pydantic validates a single item. A body of at
least ``parse_off_loop_min_bytes`` is parsed and validated in a child process, after a shape
scan by msgspec (an over-long message list is refused without building a Python object per
message). Why a process, not a thread: orjson, msgspec and pydantic-core each hold the GIL for
the whole of a call, so in a thread a 60 MB body would stall the event loop just the same.

The pool is bounded (``parse_processes``); bodies beyond it wait their turn off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Annotated, Any

import msgspec

from . import protocol
from .errors import APIError, unavailable

log = logging.getLogger("isogate.intake")


class _Shape(msgspec.Struct):
    """What is read of a large body before it is parsed for real: the length of its lists."""

    messages: (
        Annotated[list[msgspec.Raw], msgspec.Meta(max_length=protocol.MAX_MESSAGES)] | None
    ) = None


_SHAPE = msgspec.json.Decoder(_Shape)

# (parsed request, None) or (None, the refusal as APIError's fields)
_Parsed = tuple[Any, tuple[int, str, str, str | None, str | None] | None]


def parse_in_child(body: bytes, schema: type[Any]) -> _Parsed:
    """Runs in a pool process: the shape scan, then ``protocol.parse_request``."""
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
        return protocol.parse_request(body, schema), None
    except APIError as error:
        return None, (error.status, error.message, error.type, error.code, error.param)


def _warm() -> None:
    """Nothing: the first call starts the process (and its imports) before a body waits on it."""


class BodyParser:
    """Parses request bodies: small ones on the loop, large ones in a bounded process pool."""

    def __init__(self, *, off_loop_min_bytes: int, processes: int) -> None:
        self._min_bytes = off_loop_min_bytes
        self._processes = processes
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["gateway.intake"])
        self._pool: ProcessPoolExecutor | None = None
        self._slots = asyncio.Semaphore(processes)

    def start(self) -> None:
        self._pool = ProcessPoolExecutor(self._processes, mp_context=self._context)
        self._pool.submit(_warm)

    async def parse(self, body: bytes, schema: type[Any]) -> Any:
        if len(body) < self._min_bytes or self._pool is None:
            return protocol.parse_request(body, schema)
        async with self._slots:
            pool = self._pool
            try:
                parsed, refused = await asyncio.wrap_future(
                    pool.submit(parse_in_child, body, schema)
                )
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
