"""How late the event loop runs: one task that sleeps a short interval and records how much
later than asked it woke, and how much of that the loop was held by this process.

Whatever holds the loop (a body parsed, a schema validated, a prompt tokenized on it, a
blocking call) delays every request of every tenant this process serves by as long, and
nothing else in the gateway sees it. A wake-up is late by at least the time the loop was held,
less one interval (the hold may begin just after a wake-up), so the interval is short; a
wake-up costs a timer, a few subtractions, and one listing of the process's threads and a read
of each one's scheduler counters.

Lateness is also the time the loop's thread, runnable, waited for a CPU that other processes
held: on a busy host that alone reaches tens of milliseconds with the loop idle. The kernel
counts that wait per thread (``/proc/<pid>/task/<tid>/schedstat``), so the part of a wake-up's
lateness the process itself caused (its own work or blocking calls on the loop, its other
threads holding the GIL) is the lateness less that wait: the *held* time. The waits of the
process's other threads are taken off too: one that holds the GIL and waits for a CPU makes
the loop wait for the GIL as long, and on a crowded host that stretched a few milliseconds of
its work to over a hundred. That can undercount a hold that is not CPU work (a blocking call)
while other threads wait for a CPU, so held is never less than the loop thread's own CPU time
beyond one interval: its own work counts whoever else waited. Where the counters are missing
(not Linux), held is the whole lateness.

What held the loop is gone by the time the probe wakes. ``StallReport``, a diagnostic off by
default, writes where every thread was while the loop is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

PROBE_INTERVAL_S = 0.02
_TASKS = "/proc/self/task"


class WaitClock(Protocol):
    """Seconds the process's threads have waited for a CPU, as a running total."""

    def __call__(self) -> float: ...

    def close(self) -> None: ...


class RunQueueWait:
    """Seconds the process's threads have waited, runnable, for a CPU (the second field of each
    thread's schedstat), as a running total from when the clock was made: a thread counts from
    the read after it is first seen, and one that has ended keeps what it added. 0.0 where the
    kernel does not count it. Each read lists the threads once and reads each one's counter
    through a descriptor kept open while the thread lives."""

    def __init__(self) -> None:
        self._threads: dict[str, tuple[int, int]] = {}  # tid -> (descriptor, last count)
        self._total_ns = 0

    def __call__(self) -> float:
        try:
            alive = set(os.listdir(_TASKS))
        except OSError:
            return self._total_ns / 1e9  # not Linux: nothing counted
        for tid in self._threads.keys() - alive:
            os.close(self._threads.pop(tid)[0])
        for tid in alive:
            known = self._threads.get(tid)
            try:
                if known is None:
                    self._threads[tid] = _counter(tid)
                    continue
                fd, last = known
                count = _run_delay_ns(fd)
            except (OSError, IndexError, ValueError):
                # Ended since the listing, or its id is now a new thread's: that one is
                # counted from when it is seen again.
                if known is not None:
                    os.close(self._threads.pop(tid)[0])
                continue
            self._total_ns += count - last
            self._threads[tid] = fd, count
        return self._total_ns / 1e9

    def close(self) -> None:
        for fd, _ in self._threads.values():
            os.close(fd)
        self._threads.clear()


def _counter(tid: str) -> tuple[int, int]:
    """A thread's schedstat, opened, and its count now."""
    fd = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
    try:
        return fd, _run_delay_ns(fd)
    except (OSError, IndexError, ValueError):
        os.close(fd)
        raise


def _run_delay_ns(fd: int) -> int:
    return int(os.pread(fd, 128, 0).split()[1])


class StallReport:
    """The stacks of every thread, appended to a file of this process's in ``directory`` each
    time the loop has not woken the probe for ``after_s``, written by a thread of its own while
    the loop is still held, so that they show what held it (or, on a busy host, where the loop
    waited for a CPU).

    The watcher is a plain thread that looks every ``after_s / 4`` at when the probe last woke;
    the loop only writes that time. (``faulthandler``'s own watchdog needs no GIL, but re-arming
    it at every wake-up joins its previous thread: on a loaded host the loop waited for that
    thread to be scheduled, and the report made the holds it was there to explain.) To look it
    needs the GIL, which the interpreter hands over within its switch interval; a long C call
    that keeps the GIL is seen when it returns.

    After a wake-up that found the loop held ``after_s`` or more, a line says how long, and for
    how much of it the loop's thread ran on a CPU: its own work ran about as long as the hold; a
    blocking call ran little, and the stacks show it.

    For a hold that cannot be reproduced at will (the real-engine fuzzing's): off in production.
    """

    def __init__(self, directory: Path, after_s: float) -> None:
        self.path = directory / f"loop-stalls-{os.getpid()}.txt"  # one per serving process
        self._after_s = after_s
        self._fd: int | None = None
        self._last_wake = 0.0
        self._thread_time = 0.0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StallReport:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._last_wake, self._thread_time = time.monotonic(), time.thread_time()
        self._watcher = threading.Thread(target=self._watch, name="loop-stall-report", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def woke(self, late_s: float, held_s: float) -> None:
        """After a wake-up of the probe (on the loop's thread): the line of a long hold."""
        assert self._fd is not None, "used outside its with block"
        if held_s >= self._after_s:
            ran_s = time.thread_time() - self._thread_time
            os.write(
                self._fd,
                f"loop held {held_s * 1000:.0f} ms (late {late_s * 1000:.0f} ms), its thread on "
                f"a CPU {ran_s * 1000:.0f} ms since the wake-up before; woke at "
                f"{_now()}\n".encode(),
            )
        self._last_wake, self._thread_time = time.monotonic(), time.thread_time()

    def _watch(self) -> None:
        reported = None  # the wake-up whose stall was written: once per stall
        while not self._stop.wait(self._after_s / 4):
            last_wake = self._last_wake
            waited_s = time.monotonic() - last_wake
            if waited_s < self._after_s or last_wake == reported or self._fd is None:
                continue
            reported = last_wake
            os.write(
                self._fd, f"loop not woken for {waited_s * 1000:.0f} ms at {_now()}:\n".encode()
            )
            faulthandler.dump_traceback(self._fd, all_threads=True)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class LoopLagProbe:
    """Sleeps ``interval_s`` again and again on the running loop and passes each wake-up's
    lateness and held time (seconds, never negative) to ``observe``; runs until cancelled.

    ``run_queue_wait`` makes the clock of the process's CPU waits, on the loop's thread (a test
    gives its own). With ``stall_report``, each wake-up tells it.
    """

    def __init__(
        self,
        observe: Callable[[float, float], None],
        *,
        interval_s: float = PROBE_INTERVAL_S,
        run_queue_wait: Callable[[], WaitClock] = RunQueueWait,
        stall_report: StallReport | None = None,
    ) -> None:
        self._observe = observe
        self._interval_s = interval_s
        self._run_queue_wait = run_queue_wait
        self._stall_report = stall_report

    async def run(self) -> None:
        # Each wake-up is a timer's callback, not a coroutine's ``asyncio.sleep``: no future
        # and no task step per wake-up, fifty times a second on an idle gateway.
        loop = asyncio.get_running_loop()
        with self._stall_report or contextlib.nullcontext() as report:
            await self._run(loop, report)

    async def _run(self, loop: asyncio.AbstractEventLoop, report: StallReport | None) -> None:
        waited = self._run_queue_wait()
        interval_s = self._interval_s
        before, ran_before = waited(), time.thread_time()
        due = loop.time() + interval_s
        timer: asyncio.TimerHandle

        def wake() -> None:
            nonlocal before, ran_before, due, timer
            # The loop may run a timer up to its clock's resolution early: not negative lag.
            late = max(0.0, loop.time() - due)
            now, ran = waited(), time.thread_time()
            due = loop.time() + interval_s
            timer = loop.call_at(due, wake)
            own_work = min(late, ran - ran_before - interval_s)
            held = max(0.0, late - (now - before), own_work)
            if report is not None:
                report.woke(late, held)
            self._observe(late, held)
            before, ran_before = now, ran

        timer = loop.call_at(due, wake)
        try:
            await loop.create_future()  # until cancelled
        finally:
            timer.cancel()
            waited.close()
