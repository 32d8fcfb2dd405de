"""``gateway.common.deadlines.DeadlineSweep``: a deadline that passed is called once, a disarmed or
unwatched one never, and nothing runs while nothing is watched."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from gateway.common.deadlines import NEVER, DeadlineSweep

pytestmark = pytest.mark.anyio

RESOLUTION_S = 0.01


class Connection:
    def __init__(self, deadline: float = NEVER) -> None:
        self.deadline = deadline
        self.passed = 0

    def deadline_passed(self) -> None:
        self.passed += 1


async def _sweeps(count: int = 5) -> None:
    await asyncio.sleep(RESOLUTION_S * count)


async def test_a_passed_deadline_is_called_once_and_disarmed() -> None:
    loop = asyncio.get_running_loop()
    sweep = DeadlineSweep(RESOLUTION_S)
    connection = Connection(loop.time() + RESOLUTION_S)
    sweep.watch(connection, loop)
    await _sweeps()
    assert connection.passed == 1
    assert connection.deadline == NEVER
    sweep.unwatch(connection)


async def test_a_deadline_not_yet_due_or_disarmed_is_not_called() -> None:
    loop = asyncio.get_running_loop()
    sweep = DeadlineSweep(RESOLUTION_S)
    later, disarmed = Connection(loop.time() + 60), Connection(loop.time() + RESOLUTION_S)
    sweep.watch(later, loop)
    sweep.watch(disarmed, loop)
    disarmed.deadline = NEVER
    await _sweeps()
    assert (later.passed, disarmed.passed) == (0, 0)
    sweep.unwatch(later)
    sweep.unwatch(disarmed)


async def test_an_unwatched_connection_is_not_called() -> None:
    loop = asyncio.get_running_loop()
    sweep = DeadlineSweep(RESOLUTION_S)
    connection = Connection(loop.time())
    sweep.watch(connection, loop)
    sweep.unwatch(connection)
    await _sweeps()
    assert connection.passed == 0


async def test_the_sweep_stops_once_nothing_is_watched_and_restarts_on_watch() -> None:
    loop = asyncio.get_running_loop()
    sweep = DeadlineSweep(RESOLUTION_S)
    first = Connection()
    sweep.watch(first, loop)
    sweep.unwatch(first)
    await _sweeps(3)
    assert sweep._timer is None
    second = Connection(loop.time())
    sweep.watch(second, loop)
    await _sweeps()
    assert second.passed == 1
    sweep.unwatch(second)


async def test_a_pickled_sweep_arrives_empty_with_its_resolution() -> None:
    loop = asyncio.get_running_loop()
    sweep = DeadlineSweep(RESOLUTION_S)
    sweep.watch(Connection(), loop)
    copy = pickle.loads(pickle.dumps(sweep))
    assert copy.resolution_s == RESOLUTION_S
    assert copy._timer is None and not copy._watched
