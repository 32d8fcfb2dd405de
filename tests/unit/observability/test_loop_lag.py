"""The loop lag probe sees a loop held by blocking work, tells it from a wait for a CPU, and the
series expose the worst stall since the last scrape once; its stall report shows what held it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.loop_lag import LoopLagProbe, RunQueueWait, StallReport, WaitClock
from gateway.observability.metrics import Metrics

BLOCK_S = 0.3
INTERVAL_S = 0.02
# A sleep on the loop is held time less one interval (it may start just after a wake-up) and
# less what the process's other threads (pytest's, the stall report's) waited for a CPU
# meanwhile, which a busy host makes tens of milliseconds.
SLEEP_HELD_AT_LEAST_S = BLOCK_S / 2


def _lag_samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("isogate_event_loop")
        for sample in family.samples
    }


class _Waits:
    """A wait clock that reports ``waits_s`` more CPU wait once ``blocked`` is set: what the
    kernel would count if the block had been a wait for a CPU."""

    def __init__(self, waits_s: float) -> None:
        self.waits_s = waits_s
        self.blocked = False
        self.closed = False

    def __call__(self) -> float:
        return self.waits_s if self.blocked else 0.0

    def block(self) -> None:
        self.blocked = True

    def close(self) -> None:
        self.closed = True


def _spin(seconds: float) -> None:
    """Work on the CPU, as a long callback does."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _probe_across_a_block(
    observe: Callable[[float, float], None],
    block_s: float,
    clock: Callable[[], WaitClock] = RunQueueWait,
    on_block: Callable[[], None] = lambda: None,
    stall_report: StallReport | None = None,
    hold: Callable[[float], None] = time.sleep,
) -> None:
    """Runs the probe with ``observe``, holds the loop with a blocking callback (``hold``), and
    returns once the probe has woken after it."""
    woke = asyncio.Event()

    def observed(late: float, held: float) -> None:
        observe(late, held)
        woke.set()

    def block() -> None:
        on_block()
        hold(block_s)

    task = asyncio.create_task(
        LoopLagProbe(
            observed, interval_s=INTERVAL_S, run_queue_wait=clock, stall_report=stall_report
        ).run()
    )
    await woke.wait()  # the probe runs and is asleep again
    woke.clear()
    asyncio.get_running_loop().call_soon(block)
    await asyncio.sleep(0)  # the blocking callback runs here
    await woke.wait()  # the first wake-up after the block
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_callback_that_blocks_the_loop_shows_up_as_lag_and_held_time() -> None:
    observed: list[tuple[float, float]] = []
    asyncio.run(_probe_across_a_block(lambda *wake: observed.append(wake), BLOCK_S))
    late, held = max(observed)
    # At least the block less one interval (it may start just after a wake-up); sleeping on
    # the loop is not a wait for a CPU, so it was held.
    assert late >= BLOCK_S - INTERVAL_S
    assert held >= SLEEP_HELD_AT_LEAST_S


def test_lateness_spent_waiting_for_a_cpu_is_not_held_time() -> None:
    observed: list[tuple[float, float]] = []
    waits = _Waits(waits_s=BLOCK_S + 1.0)
    probed = _probe_across_a_block(
        lambda *wake: observed.append(wake), BLOCK_S, clock=lambda: waits, on_block=waits.block
    )
    asyncio.run(probed)
    late, held = max(observed)
    assert late >= BLOCK_S - INTERVAL_S
    assert held == 0.0
    assert waits.closed  # the probe closes its clock when cancelled


def test_the_loops_own_cpu_work_is_held_time_however_long_other_threads_waited() -> None:
    observed: list[tuple[float, float]] = []
    waits = _Waits(waits_s=BLOCK_S + 1.0)  # as if another thread had waited all along
    probed = _probe_across_a_block(
        lambda *wake: observed.append(wake),
        BLOCK_S,
        clock=lambda: waits,
        on_block=waits.block,
        hold=_spin,
    )
    asyncio.run(probed)
    late, held = max(observed)
    # Its own CPU time beyond one interval, whatever the waits (a busy host may have made the
    # spin take longer than its CPU time: late, not held).
    assert late >= BLOCK_S - INTERVAL_S
    assert held >= BLOCK_S - 2 * INTERVAL_S


def test_a_stall_report_shows_what_held_the_loop_while_it_was_held(tmp_path: Path) -> None:
    report = StallReport(tmp_path, after_s=BLOCK_S / 3)
    asyncio.run(_probe_across_a_block(lambda *wake: None, BLOCK_S, stall_report=report))
    written = report.path.read_text()
    # The loop's thread, in the blocking callback, from faulthandler's watchdog; then the line
    # of the wake-up after it: a sleep is a hold during which the thread hardly ran.
    assert f'{Path(__file__).name}", line' in written and "in block" in written
    line = written.rstrip().splitlines()[-1]
    assert line.startswith("loop held ") and written.index("in block") < written.index(line)
    held_ms, ran_ms = (int(part.split(" ms")[0].split()[-1]) for part in line.split(",")[:2])
    assert held_ms >= SLEEP_HELD_AT_LEAST_S * 1000 and ran_ms < held_ms / 2
    time.sleep(BLOCK_S)  # the probe is gone: nothing re-arms the watchdog, nor may it fire
    assert report.path.read_text() == written


def test_gauges_hold_the_worst_since_the_last_scrape_the_histogram_every_lag() -> None:
    metrics = Metrics()
    for late, held in ((0.001, 0.001), (0.4, 0.05), (0.03, 0.03)):
        metrics.loop_lag.observe(late, held)

    first = _lag_samples(metrics)
    assert first[("isogate_event_loop_lag_max_seconds", "")] == 0.4
    assert first[("isogate_event_loop_held_max_seconds", "")] == 0.05
    assert first[("isogate_event_loop_lag_seconds_count", "")] == 3
    assert first[("isogate_event_loop_lag_seconds_bucket", "0.1")] == 2
    assert first[("isogate_event_loop_lag_seconds_sum", "")] == pytest.approx(0.431)

    second = _lag_samples(metrics)
    assert second[("isogate_event_loop_lag_max_seconds", "")] == 0.0
    assert second[("isogate_event_loop_held_max_seconds", "")] == 0.0
    assert second[("isogate_event_loop_lag_seconds_count", "")] == 3


def test_a_blocked_loop_reaches_the_scraped_gauges() -> None:
    metrics = Metrics()
    asyncio.run(_probe_across_a_block(metrics.loop_lag.observe, BLOCK_S))
    samples = _lag_samples(metrics)
    assert samples[("isogate_event_loop_lag_max_seconds", "")] >= BLOCK_S - INTERVAL_S
    assert samples[("isogate_event_loop_held_max_seconds", "")] >= SLEEP_HELD_AT_LEAST_S


def test_the_run_queue_wait_clock_reads_the_kernels_counters_and_never_goes_back() -> None:
    clock = RunQueueWait()
    try:
        first = clock()
        second = clock()
    finally:
        clock.close()
    assert 0.0 <= first <= second


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the kernel's counters: Linux")
def test_the_run_queue_wait_clock_counts_the_other_threads_waits_for_a_cpu() -> None:
    """Two threads that hash without the GIL, on one CPU, each wait for it about half the time
    while this one sleeps: their waits are the clock's, though this thread never waited."""
    stop = threading.Event()
    block = b"x" * (1 << 20)  # hashlib lets the GIL go for data this long

    def hash_until_stopped() -> None:
        while not stop.is_set():
            hashlib.sha256(block).digest()

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread's; the workers inherit it
    clock = RunQueueWait()
    workers = [threading.Thread(target=hash_until_stopped) for _ in range(2)]
    try:
        clock()  # the workers are counted from the read after they are first seen
        for worker in workers:
            worker.start()
        time.sleep(0.05)
        before = clock()
        time.sleep(BLOCK_S)
        waited = clock() - before
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        os.sched_setaffinity(0, allowed)
        clock.close()
    assert waited >= BLOCK_S / 3
