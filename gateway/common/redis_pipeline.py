"""Redis commands of concurrent requests sent together: one pipeline per round trip.

The problem: with Redis configured (``isogate serve --workers N``, replicas), every request
asks Redis several things of its own (its tenant's limits, its KV claim, their releases),
and redis-py spends far more of the gateway's CPU on each round trip (a connection taken
from the pool, a write, a wakeup, a parse) than Redis spends answering it. Sent one by one,
the round trips cost a request more than everything else it does.

What this does (the auto-pipelining of ioredis, for redis-py): a command is queued, and one
flush sends every command queued by then as one pipeline on one connection, then hands each
caller its own reply (or its own error). While a flush is on the wire, new commands wait for
the next one, so under load each round trip carries the commands of many requests, and at
one request in flight a command goes out as soon as the loop turns. Order and meaning are
the caller's: each command is what it would be alone (no transaction), and a caller awaits
its reply as before, so a release awaited before an answer is still done when the answer is.

The invariant: every queued command's future is resolved exactly once, with its reply, its
own error, or the flush's error (a flush that fails or outlasts ``timeout_s`` fails all of its
commands: whatever Redis did, nothing is known, as when a lone command fails).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    command: tuple[Any, ...]
    future: asyncio.Future[Any]
    script: Any = None  # the redis-py ``Script`` an EVALSHA runs, to load it if Redis lost it


class RedisPipeline:
    """Sends the commands queued between round trips as one pipeline (see the module doc).

    A command is ``submit``-ted (its reply a future) or awaited (``execute_command``); a
    redis-py ``Script`` is ``submit_script``-ed or awaited (``run_script``). Commands reach
    Redis in the order they were submitted, with one exception: a script Redis lost (it
    restarted, or its scripts were flushed) is loaded and its commands sent again after the
    rest of their round trip, before any later one. A script's first use here sends its text
    (``EVAL``, which Redis keeps), so a first use keeps its place too."""

    def __init__(self, redis: Any, *, timeout_s: float = 1.0) -> None:
        self._redis = redis
        self._timeout_s = timeout_s
        self._queued: list[_Queued] = []
        self._flushing: asyncio.Task[None] | None = None
        # The scripts (by SHA) sent whole once already: Redis has them, unless it lost them.
        self._sent_scripts: set[str] = set()

    def submit(self, *command: Any) -> asyncio.Future[Any]:
        """Queue ``command`` for the next round trip; its future holds the reply."""
        return self._queue(_Queued(command, asyncio.get_running_loop().create_future()))

    def submit_script(
        self, script: Any, keys: Sequence[Any], args: Sequence[Any]
    ) -> asyncio.Future[Any]:
        """Queue a registered redis-py ``Script`` (run by its SHA); its future holds the reply."""
        if script.sha in self._sent_scripts:
            command: tuple[Any, ...] = ("EVALSHA", script.sha, len(keys), *keys, *args)
        else:
            self._sent_scripts.add(script.sha)
            command = ("EVAL", script.script, len(keys), *keys, *args)
        return self._queue(_Queued(command, asyncio.get_running_loop().create_future(), script))

    async def execute_command(self, *command: Any) -> Any:
        return await self.submit(*command)

    async def run_script(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return await self.submit_script(script, keys, args)

    def _queue(self, queued: _Queued) -> asyncio.Future[Any]:
        self._queued.append(queued)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return queued.future

    async def _flush(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await self._send(batch)
        finally:
            self._flushing = None

    async def _send(self, batch: list[_Queued]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                replies = await self._round_trip(batch)
                lost = [i for i, reply in enumerate(replies) if _lost_script(reply, batch[i])]
                if lost:  # Redis restarted or was flushed: load, send those again, in order
                    for script in {id(batch[i].script): batch[i].script for i in lost}.values():
                        script.sha = await self._redis.script_load(script.script)
                    again = [_Queued(_with_sha(batch[i]), batch[i].future) for i in lost]
                    for i, reply in zip(lost, await self._round_trip(again), strict=True):
                        replies[i] = reply
        except BaseException as exc:
            for queued in batch:
                if not queued.future.done():
                    failure = exc if isinstance(exc, Exception) else ConnectionError()
                    queued.future.set_exception(failure)
            if not isinstance(exc, Exception):
                raise  # cancelled: the callers were told, the cancellation goes on
            return
        for queued, reply in zip(batch, replies, strict=True):
            if queued.future.done():  # its caller stopped waiting (a timeout, a client gone)
                continue
            if isinstance(reply, Exception):
                queued.future.set_exception(reply)
            else:
                queued.future.set_result(reply)

    async def _round_trip(self, batch: list[_Queued]) -> list[Any]:
        if len(batch) == 1:  # alone, a command costs less without a pipeline around it
            try:
                return [await self._redis.execute_command(*batch[0].command)]
            except Exception as exc:  # a reply that is an error is the caller's, as below
                if redis_unreachable(exc):
                    raise
                return [exc]
        async with self._redis.pipeline(transaction=False) as pipe:
            for queued in batch:
                pipe.execute_command(*queued.command)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            return replies

    async def aclose(self) -> None:
        """Wait for the commands under way (a release queued at shutdown still goes out)."""
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)

    async def __aenter__(self) -> RedisPipeline:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _lost_script(reply: Any, queued: _Queued) -> bool:
    import redis.exceptions

    return queued.script is not None and isinstance(reply, redis.exceptions.NoScriptError)


def _with_sha(queued: _Queued) -> tuple[Any, ...]:
    return ("EVALSHA", queued.script.sha, *queued.command[2:])


def redis_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis could not be reached or did not answer in time (as opposed
    to a reply that is an error): what every caller falls back or fails closed on."""
    import redis.exceptions

    return isinstance(
        exc,
        redis.exceptions.ConnectionError
        | redis.exceptions.TimeoutError
        | OSError
        | asyncio.TimeoutError,
    )
