"""The loop lag probe sees a loop held by blocking work, and the series expose the worst stall
since the last scrape once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.loop_lag import LoopLagProbe
from gateway.observability.metrics import Metrics

BLOCK_S = 0.3
INTERVAL_S = 0.02


def _lag_samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("isogate_event_loop_lag")
        for sample in family.samples
    }


async def _probe_across_a_block(observe: Callable[[float], None], block_s: float) -> None:
    """Runs the probe with ``observe``, holds the loop with a blocking callback, and returns once
    the probe has woken after it."""
    woke = asyncio.Event()

    def observed(seconds: float) -> None:
        observe(seconds)
        woke.set()

    task = asyncio.create_task(LoopLagProbe(observed, interval_s=INTERVAL_S).run())
    await woke.wait()  # the probe runs and is asleep again
    woke.clear()
    asyncio.get_running_loop().call_soon(time.sleep, block_s)
    await asyncio.sleep(0)  # the blocking callback runs here
    await woke.wait()  # the first wake-up after the block
    task.cancel()


def test_a_callback_that_blocks_the_loop_shows_up_as_lag_of_the_block_less_one_interval() -> None:
    observed: list[float] = []
    asyncio.run(_probe_across_a_block(observed.append, BLOCK_S))
    assert max(observed) >= BLOCK_S - INTERVAL_S


def test_the_largest_lag_is_exposed_once_and_every_wake_up_stays_in_the_histogram() -> None:
    metrics = Metrics()
    for seconds in (0.001, 0.4, 0.03):
        metrics.loop_lag.observe(seconds)

    first = _lag_samples(metrics)
    assert first[("isogate_event_loop_lag_max_seconds", "")] == 0.4
    assert first[("isogate_event_loop_lag_seconds_count", "")] == 3
    assert first[("isogate_event_loop_lag_seconds_bucket", "0.1")] == 2
    assert first[("isogate_event_loop_lag_seconds_sum", "")] == pytest.approx(0.431)

    second = _lag_samples(metrics)
    assert second[("isogate_event_loop_lag_max_seconds", "")] == 0.0
    assert second[("isogate_event_loop_lag_seconds_count", "")] == 3


def test_a_blocked_loop_reaches_the_scraped_gauge() -> None:
    metrics = Metrics()
    asyncio.run(_probe_across_a_block(metrics.loop_lag.observe, BLOCK_S))
    largest = _lag_samples(metrics)[("isogate_event_loop_lag_max_seconds", "")]
    assert largest >= BLOCK_S - INTERVAL_S
