"""Token budgets over a day or a month (issue 45): refused once spent, charged after the
response, a soft threshold counted once, and counters rebuilt from the durable record (the
audit log) wherever they are missing. In memory and in real Redis."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis.asyncio as redis_asyncio

from gateway.common.errors import APIError
from gateway.config.policies import Policies, PolicyError, load_policies
from gateway.observability.metrics import Metrics
from gateway.tenancy.budgets import BudgetHold, TokenBudgets, period_bounds
from tests.unit.config.test_model_access import write

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Record:
    """The audit log as the budgets read it: tokens per (tenant, model, moment)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, datetime, int]] = []
        self.reads = 0

    def usage_since(self, tenant: str, since: datetime, model: str | None) -> int:
        self.reads += 1
        return sum(
            tokens
            for who, which, moment, tokens in self.events
            if who == tenant and moment >= since and model in (None, which)
        )


@pytest.fixture(params=["memory", "redis"])
def budgets_factory(
    request: pytest.FixtureRequest, redis_client: redis_asyncio.Redis, redis_prefix: str
) -> Callable[[Record, Clock, Metrics | None], TokenBudgets]:
    """Budgets as a gateway replica makes them: each call a new replica (or a restarted one)."""
    redis = redis_client if request.param == "redis" else None
    return lambda record, clock, metrics: TokenBudgets(
        redis, redis_prefix, record.usage_since, metrics, clock=clock
    )


def _policies(tmp_path: Path, budget: dict[str, object], **tenant: object) -> Policies:
    return load_policies(write(tmp_path, tenants={"acme": {"budget": budget, **tenant}}))


def _with_model_budget(tmp_path: Path, tokens: int, **tenant: object) -> Policies:
    """Policies where acme's model ``large`` has a daily budget of ``tokens``."""
    budgets = {"large": {"tokens": tokens, "period": "day"}}
    return load_policies(write(tmp_path, tenants={"acme": {"model_budgets": budgets, **tenant}}))


async def _served(budgets: TokenBudgets, policies: Policies, model: str = "small") -> bytes:
    """Admitted (both the early look and the reservation, of nothing): its header lines."""
    await budgets.check(policies, "acme", policies.models[model])
    hold = await budgets.reserve(policies, "acme", policies.models[model], 0)
    return b"" if hold is None else hold.header_lines


async def _held(
    budgets: TokenBudgets, policies: Policies, tokens: int, model: str = "small"
) -> BudgetHold:
    hold = await budgets.reserve(policies, "acme", policies.models[model], tokens)
    assert hold is not None
    return hold


async def _refused(budgets: TokenBudgets, policies: Policies, model: str = "small") -> APIError:
    with pytest.raises(APIError) as raised:
        await _served(budgets, policies, model)
    return raised.value


async def _use(
    budgets: TokenBudgets,
    policies: Policies,
    record: Record,
    clock: Clock,
    tokens: int,
    model: str = "small",
) -> None:
    """A served request: its tokens reserved, then settled as used, and its event in the
    audit log."""
    hold = await budgets.reserve(policies, "acme", policies.models[model], tokens)
    if hold is not None:
        hold.settle(tokens)
        await budgets.drain()
    record.events.append(("acme", model, clock.now, tokens))


async def test_a_daily_budget_refuses_once_spent_and_renews_the_next_day(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    lines = await _served(budgets, policies)
    assert b"x-budget-limit-tokens: 100\r\n" in lines
    assert b"x-budget-remaining-tokens: 100\r\n" in lines
    assert b"x-budget-reset: 2026-12-06T00:00:00Z\r\n" in lines
    await _use(budgets, policies, record, clock, 60)
    assert b"x-budget-remaining-tokens: 40\r\n" in await _served(budgets, policies)
    await _use(budgets, policies, record, clock, 60)  # the last request may overshoot
    error = await _refused(budgets, policies)
    assert (error.status, error.code) == (429, "budget_exceeded")
    assert error.message == (
        "Token budget spent: the tenant's 100 tokens per day are used (120); "
        "it renews at 2026-12-06T00:00:00Z."
    )
    assert error.headers["Retry-After"] == str(12 * 3600 + 1)
    assert error.headers["x-budget-remaining-tokens"] == "0"
    clock.now = datetime(2026, 12, 6, 0, 0, 1, tzinfo=UTC)
    assert b"x-budget-remaining-tokens: 100\r\n" in await _served(budgets, policies)


async def test_a_monthly_budget_spans_the_calendar_month(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _policies(tmp_path, {"tokens": 100, "period": "month"})
    await _served(budgets, policies)
    await _use(budgets, policies, record, clock, 100)
    clock.now = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert (await _refused(budgets, policies)).headers["x-budget-reset"] == "2027-01-01T00:00:00Z"
    clock.now = datetime(2027, 1, 1, tzinfo=UTC)
    await _served(budgets, policies)


async def test_a_restarted_replica_rebuilds_the_count_from_the_audit_log(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    # Yesterday's use is not today's.
    record.events.append(("acme", "small", datetime(2026, 12, 4, 23, 0, tzinfo=UTC), 500))
    first = budgets_factory(record, clock, None)
    await _served(first, policies)
    await _use(first, policies, record, clock, 70)
    restarted = budgets_factory(record, clock, None)
    assert b"x-budget-remaining-tokens: 30\r\n" in await _served(restarted, policies)
    await _use(restarted, policies, record, clock, 30)
    assert (await _refused(budgets_factory(record, clock, None), policies)).status == 429


async def test_replicas_sharing_redis_share_the_count_without_reading_the_log_again(
    tmp_path: Path, redis_client: redis_asyncio.Redis, redis_prefix: str
) -> None:
    record, clock = Record(), Clock()
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    first, second = (
        TokenBudgets(redis_client, redis_prefix, record.usage_since, clock=clock) for _ in "ab"
    )
    await _served(first, policies)
    assert record.reads == 1
    await _use(first, policies, record, clock, 100)
    assert (await _refused(second, policies)).code == "budget_exceeded"
    assert record.reads == 1  # the counter was there: no rebuild, nothing counted twice


async def test_a_charge_without_a_counter_is_left_to_the_rebuild(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    # A request that reserved nothing (its budget set while it ran), before any counter.
    await budgets.charge(policies, "acme", policies.models["small"], 40)
    record.events.append(("acme", "small", clock.now, 40))
    assert b"x-budget-remaining-tokens: 60\r\n" in await _served(budgets, policies)  # not twice


async def test_requests_in_flight_together_are_counted_together(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    first = await _held(budgets, policies, 60)
    assert b"x-budget-remaining-tokens: 100\r\n" in first.header_lines
    second = await _held(budgets, policies, 60)  # the last admitted may overshoot
    assert b"x-budget-remaining-tokens: 40\r\n" in second.header_lines
    # 120 of 100 reserved: spent while both run, though neither has been charged yet.
    assert (await _refused(budgets, policies)).code == "budget_exceeded"
    first.settle(10)  # used less than it reserved: the rest given back
    second.settle(0)  # failed: nothing used
    await budgets.drain()
    assert b"x-budget-remaining-tokens: 90\r\n" in await _served(budgets, policies)


async def test_a_hold_is_settled_once(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    hold = await _held(budgets, policies, 50)
    hold.settle(20)
    hold.settle(20)
    await budgets.drain()
    assert b"x-budget-remaining-tokens: 80\r\n" in await _served(budgets, policies)


async def test_a_reservation_is_all_or_none_over_the_tenant_and_model_budgets(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _with_model_budget(tmp_path, 30, budget={"tokens": 100, "period": "day"})
    held = await _held(budgets, policies, 30, "large")  # both budgets: 30 each
    error = await _refused(budgets, policies, "large")  # the model's is spent
    assert error.headers["x-budget-scope"] == "model large"
    # The refused one reserved nothing of the tenant's budget: 70 left there, not 40.
    assert b"x-budget-remaining-tokens: 70\r\n" in await _served(budgets, policies, "small")
    held.settle(30)
    await budgets.drain()


async def test_replicas_sharing_redis_count_each_others_requests_in_flight(
    tmp_path: Path, redis_client: redis_asyncio.Redis, redis_prefix: str
) -> None:
    record, clock = Record(), Clock()
    policies = _policies(tmp_path, {"tokens": 100, "period": "day"})
    first, second = (
        TokenBudgets(redis_client, redis_prefix, record.usage_since, clock=clock) for _ in "ab"
    )
    hold = await _held(first, policies, 100)
    assert (await _refused(second, policies)).code == "budget_exceeded"
    hold.settle(0)
    await first.drain()
    assert b"x-budget-remaining-tokens: 100\r\n" in await _served(second, policies)


async def test_a_model_budget_counts_that_model_only(
    tmp_path: Path, budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets]
) -> None:
    record, clock = Record(), Clock()
    budgets = budgets_factory(record, clock, None)
    policies = _with_model_budget(tmp_path, 50)
    assert await _served(budgets, policies, "small") == b""  # no budget on it: no headers
    await _served(budgets, policies, "large")
    await _use(budgets, policies, record, clock, 500, "small")
    assert b"x-budget-scope: model large\r\n" in await _served(budgets, policies, "large")
    await _use(budgets, policies, record, clock, 50, "large")
    error = await _refused(budgets, policies, "large")
    assert error.headers["x-budget-scope"] == "model large"
    assert "model large's 50 tokens per day" in error.message
    await _served(budgets, policies, "small")


async def test_the_soft_threshold_is_logged_and_counted_once(
    tmp_path: Path,
    budgets_factory: Callable[[Record, Clock, Metrics | None], TokenBudgets],
    caplog: pytest.LogCaptureFixture,
) -> None:
    record, clock, metrics = Record(), Clock(), Metrics()
    budgets = budgets_factory(record, clock, metrics)
    policies = _policies(tmp_path, {"tokens": 100, "period": "day", "soft_percent": 50})
    await _served(budgets, policies)
    crossings = metrics.budget_soft_crossings.labels("acme", "tenant")
    with caplog.at_level(logging.WARNING, logger="isogate.budgets"):
        await _use(budgets, policies, record, clock, 40)
        assert crossings._value.get() == 0
        await _use(budgets, policies, record, clock, 20)  # 60 of 100: past 50
        await _use(budgets, policies, record, clock, 20)
    assert crossings._value.get() == 1
    assert [r.message for r in caplog.records] == ["budget soft threshold crossed"]
    await _served(budgets, policies)  # past the soft threshold: still served


def test_period_bounds_of_a_day_and_of_december() -> None:
    assert period_bounds("day", datetime(2026, 12, 31, 23, 59, tzinfo=UTC)) == (
        datetime(2026, 12, 31, tzinfo=UTC),
        datetime(2027, 1, 1, tzinfo=UTC),
    )
    assert period_bounds("month", datetime(2026, 12, 15, tzinfo=UTC)) == (
        datetime(2026, 12, 1, tzinfo=UTC),
        datetime(2027, 1, 1, tzinfo=UTC),
    )


def test_a_budget_on_a_model_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policies(
            write(
                tmp_path,
                tenants={"acme": {"model_budgets": {"huge": {"tokens": 1, "period": "day"}}}},
            )
        )
    assert "tenants.acme.model_budgets: no such model 'huge'" in str(raised.value)
