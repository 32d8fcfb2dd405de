"""Liveness of a worker whose capacity polls fail (gateway.workers.capacity), against a stand-in.

A slow worker's record is routed on while it is alive; its liveness must be renewed by
``/health`` before its last sign of life goes stale, or a slow worker looks dead for a moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.workers.capacity import CapacityRegistry
from tests.harness import wait_until
from tests.standin_worker import Behaviour, StandInWorker

pytestmark = pytest.mark.anyio

STALE_AFTER_S = 1.0  # a poll times out after half of it


@pytest.fixture
async def polled() -> AsyncIterator[tuple[CapacityRegistry, StandInWorker]]:
    worker = StandInWorker("decode").start()
    # A tick far longer than the test: any probe it sees was woken by a failed poll.
    registry = CapacityRegistry(
        poll_interval_s=600, stale_after_s=STALE_AFTER_S, max_age_if_alive_s=600
    )
    registry.set_workers([(worker.url, "decode")])
    prober = asyncio.create_task(registry.run_liveness())
    try:
        yield registry, worker
    finally:
        prober.cancel()
        await registry.close()
        worker.stop()


async def test_a_failed_poll_has_the_worker_probed_at_once_not_at_the_next_tick(polled) -> None:
    registry, worker = polled
    await registry.refresh()
    state = registry.get(worker.url)
    assert state is not None and registry.alive(worker.url)
    worker.behaviour = Behaviour(capacity_delay_s=60)  # busy: its polls time out, it serves
    await registry.refresh()
    assert registry.error(worker.url)
    # Its record stays usable while it is alive: renewed past the good poll's own window (the
    # failed poll alone took half of it) only by a /health answered since.
    renewed_past = state.observed_at + STALE_AFTER_S + STALE_AFTER_S / 4
    await wait_until(lambda: registry.usable_until(state) > renewed_past, timeout_s=5)
    assert worker.health_probes == 1
    assert registry.liveness_error(worker.url) is None


async def test_a_worker_whose_polls_answer_is_not_asked_for_its_health(polled) -> None:
    registry, worker = polled
    for _ in range(3):
        await registry.refresh()
    await asyncio.sleep(0.2)
    assert registry.alive(worker.url) and worker.health_probes == 0
