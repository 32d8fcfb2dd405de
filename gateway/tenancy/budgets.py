"""Token budgets: the prompt + completion tokens a tenant may use over a UTC day or calendar
month, over all its models (tenants.yaml ``budget``) and over one (``model_budgets``).

A request is refused (429 ``budget_exceeded``) once a budget it counts against is spent. A
budget is a claim, not a look: a request admitted reserves what it may use (its prompts and
``max_tokens`` for each generation) in every counter it counts against, in one atomic step that
first checks that none is spent (``reserve``); its ``BudgetHold`` is settled once, after its
response, to what it used (``BudgetHold.settle``, from the audit record; nothing for a request
that failed). So requests in flight together are counted together: what a budget's tenant can
use past it is the last admitted request's own size, however many it sends at once (checked
one by one against the counter, each request would see the same count and all would be
served). Past a budget's soft threshold a request is still served; the crossing is logged and
counted once (``isogate_budget_soft_crossings``).

Where the count lives: with Redis, one counter per (tenant, scope, period) that every replica
adds to, so replicas share a budget; without, a counter in process. Neither is the durable
record: the audit log is (every generation's event holds its tokens, its tenant and its
model). A counter that is not there (a new period, a restarted gateway without Redis, a Redis
that lost its keys) is rebuilt from the audit log before it is read, so a restart never resets
a budget. What the rebuild can miss is the events not yet written to the database at that
moment (one flush interval's); it never counts one twice, since a charge only adds to a counter
that exists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from gateway.common.errors import APIError
from gateway.common.redis_pipeline import redis_unreachable
from gateway.config.policies import ModelPolicy, Policies, TokenBudget

if TYPE_CHECKING:
    import redis.asyncio

    from gateway.observability.metrics import Metrics

log = logging.getLogger("isogate.budgets")

# The tokens since a moment, from the durable record: (tenant, since, model or None) -> tokens.
UsageSince = Callable[[str, datetime, str | None], int]

# KEYS: the counter. ARGV: tokens. Adds to a counter that exists; one that does not is rebuilt
# from the audit log (which holds this request) when next read. Returns the new count, or -1.
_CHARGE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""

# KEYS: a request's counters. ARGV[1]: the tokens to reserve; ARGV[2]: '1' to reserve nothing
# if a counter is not there (it is rebuilt from the audit log, then asked again), '0' to leave
# such a counter alone (its rebuild could not read the log: not enforced); ARGV[2 + i]: KEYS[i]'s
# budget. All or none: {0, count before, ...} (-1: not there), every counter there raised by
# the tokens when none is spent; else {i, its count} for the first spent.
_RESERVE_LUA = """
local counts, missing = {}, false
for i, key in ipairs(KEYS) do
  local found = redis.call('GET', key)
  if found then
    counts[i] = tonumber(found)
    if counts[i] >= tonumber(ARGV[i + 2]) then
      return {i, counts[i]}
    end
  else
    counts[i] = -1
    missing = true
  end
end
if missing and ARGV[2] == '1' then
  return {0, unpack(counts)}
end
for i, key in ipairs(KEYS) do
  if counts[i] >= 0 then
    redis.call('INCRBY', key, ARGV[1])
  end
end
return {0, unpack(counts)}
"""


@dataclass(frozen=True, slots=True)
class BudgetScope:
    """One budget a request counts against."""

    name: str  # "tenant" (all its models) or "model M"
    model: str | None  # None: all its models
    budget: TokenBudget


def budget_scopes(policies: Policies, tenant_id: str, model: ModelPolicy) -> list[BudgetScope]:
    policy = policies.tenant(tenant_id)
    scopes = []
    if policy.budget is not None:
        scopes.append(BudgetScope("tenant", None, policy.budget))
    own = policy.model_budgets.get(model.name)
    if own is not None:
        scopes.append(BudgetScope(f"model {model.name}", model.name, own))
    return scopes


def period_bounds(period: str, now: datetime) -> tuple[datetime, datetime]:
    """The UTC day or calendar month holding ``now``: its start and its end."""
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return start, end


@dataclass(slots=True)
class _Standing:
    scope: BudgetScope
    used: int
    ends: datetime

    @property
    def remaining(self) -> int:
        return max(0, self.scope.budget.tokens - self.used)


class TokenBudgets:
    def __init__(
        self,
        redis: redis.asyncio.Redis | None,
        key_prefix: str,
        usage_since: UsageSince,
        metrics: Metrics | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        redis_timeout_s: float = 0.5,
    ) -> None:
        self._redis = redis
        self._prefix = key_prefix
        self._usage_since = usage_since
        self._metrics = metrics
        self._clock = clock
        self._timeout_s = redis_timeout_s
        self._charge_script = redis.register_script(_CHARGE_LUA) if redis is not None else None
        self._reserve_script = redis.register_script(_RESERVE_LUA) if redis is not None else None
        # Without Redis (or while it fails): the counters of this process, by key.
        self._local: dict[str, int] = {}
        self._pending: set[asyncio.Task[None]] = set()

    async def check(self, policies: Policies, tenant_id: str, model: ModelPolicy) -> None:
        """Refuse (429 ``budget_exceeded``) if a budget the request counts against is spent:
        a look, before the request is read further (its prompt tokenized); what admits it is
        ``reserve``."""
        scopes = budget_scopes(policies, tenant_id, model)
        if not scopes:
            return
        now = self._clock()
        for scope in scopes:
            start, ends = period_bounds(scope.budget.period, now)
            standing = _Standing(scope, await self._used(tenant_id, scope, start, ends, now), ends)
            if standing.remaining <= 0:
                raise self._refusal(tenant_id, standing, now)

    async def reserve(
        self, policies: Policies, tenant_id: str, model: ModelPolicy, tokens: int
    ) -> BudgetHold | None:
        """Reserve ``tokens`` in every budget the request counts against, all or none; refuse
        (429 ``budget_exceeded``) if one is spent. None without a budget. The hold carries the
        ``x-budget-*`` header lines of the budget with the least left before it."""
        scopes = budget_scopes(policies, tenant_id, model)
        if not scopes:
            return None
        now = self._clock()
        periods = [period_bounds(scope.budget.period, now) for scope in scopes]
        keys = [
            self._key(tenant_id, scope, start)
            for scope, (start, _) in zip(scopes, periods, strict=True)
        ]
        budgets = [scope.budget.tokens for scope in scopes]
        spent, counts = await self._reserve(keys, budgets, tokens, strict=True)
        if spent is None and min(counts) < 0:
            # A counter not there: nothing was reserved. Rebuilt from the audit log, once more;
            # one whose rebuild cannot read the log is left alone (not enforced meanwhile).
            for scope, (start, ends) in zip(scopes, periods, strict=True):
                await self._used(tenant_id, scope, start, ends, now)
            spent, counts = await self._reserve(keys, budgets, tokens, strict=False)
        if spent is not None:
            spent_at = _Standing(scopes[spent], counts[spent], periods[spent][1])
            raise self._refusal(tenant_id, spent_at, now)
        standings = [
            _Standing(scope, max(0, count), ends)
            for scope, count, (_, ends) in zip(scopes, counts, periods, strict=True)
        ]
        held = [(scope, key) for scope, key, n in zip(scopes, keys, counts, strict=True) if n >= 0]
        lines = _header_lines(min(standings, key=lambda s: s.remaining))
        return BudgetHold(self, tenant_id, held, tokens, lines)

    def _refusal(self, tenant_id: str, standing: _Standing, now: datetime) -> APIError:
        if self._metrics is not None:
            self._metrics.budget_refusals.labels(tenant_id, standing.scope.name).inc()
        return _spent(standing, now)

    def charge_later(self, policies: Policies, tenant_id: str, model: str, tokens: int) -> None:
        """``charge``, from a caller that cannot wait (the audit record of a request that
        reserved nothing: its budget was set while it ran)."""
        found = policies.models.get(model)
        if found is None or tokens <= 0 or not budget_scopes(policies, tenant_id, found):
            return
        self._later(self.charge(policies, tenant_id, found, tokens))

    def _later(self, charging: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(charging)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def charge(
        self, policies: Policies, tenant_id: str, model: ModelPolicy, tokens: int
    ) -> None:
        """Add a request's tokens, as settled after its response, to every budget it counts
        against; log and count a soft threshold crossed."""
        now = self._clock()
        counters = []
        for scope in budget_scopes(policies, tenant_id, model):
            start, _ = period_bounds(scope.budget.period, now)
            counters.append((scope, self._key(tenant_id, scope, start)))
        await self._settle(tenant_id, counters, tokens, tokens)

    async def _settle(
        self, tenant_id: str, counters: list[tuple[BudgetScope, str]], used: int, delta: int
    ) -> None:
        """Add ``delta`` to each counter (a request's use less what it reserved there); log and
        count a soft threshold that its ``used`` tokens crossed."""
        for scope, key in counters:
            try:
                after = await self._add(key, delta)
            except Exception:
                log.exception("budgets: charging %s failed", key)
                continue
            if after < 0:
                continue  # no counter: rebuilt from the audit log, this request included
            soft = scope.budget.tokens * scope.budget.soft_percent / 100
            if after - used < soft <= after:
                log.warning(
                    "budget soft threshold crossed",
                    extra={
                        "tenant_id": tenant_id,
                        "scope": scope.name,
                        "used": after,
                        "budget": scope.budget.tokens,
                        "period": scope.budget.period,
                    },
                )
                if self._metrics is not None:
                    self._metrics.budget_soft_crossings.labels(tenant_id, scope.name).inc()

    async def drain(self) -> None:
        """Wait for the charges under way (at shutdown, and in tests)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    # -- the counters -----------------------------------------------------------------------

    def _key(self, tenant_id: str, scope: BudgetScope, start: datetime) -> str:
        period = start.strftime("%Y-%m-%d" if scope.budget.period == "day" else "%Y-%m")
        return f"{self._prefix}:{{{tenant_id}}}:budget:{scope.model or '*'}:{period}"

    async def _used(
        self, tenant_id: str, scope: BudgetScope, start: datetime, ends: datetime, now: datetime
    ) -> int:
        key = self._key(tenant_id, scope, start)
        redis = self._redis
        if redis is not None:
            try:
                found = await asyncio.wait_for(redis.get(key), self._timeout_s)
                if found is not None:
                    return int(found)
                rebuilt = await self._rebuilt(tenant_id, scope, start)
                if rebuilt is None:
                    return 0
                # Kept a day past its period; another replica's rebuild may have won: read back.
                ttl = int((ends - now).total_seconds()) + 86_400
                await asyncio.wait_for(redis.set(key, rebuilt, nx=True, ex=ttl), self._timeout_s)
                found = await asyncio.wait_for(redis.get(key), self._timeout_s)
                return int(found) if found is not None else rebuilt
            except Exception as exc:
                if not redis_unreachable(exc):
                    raise
                log.error("budgets: Redis unreachable (%r); counting in this process", exc)
        used = self._local.get(key)
        if used is None:
            rebuilt = await self._rebuilt(tenant_id, scope, start)
            if rebuilt is None:
                return 0
            used = self._local[key] = rebuilt
        return used

    async def _rebuilt(self, tenant_id: str, scope: BudgetScope, start: datetime) -> int | None:
        """The period's use so far from the audit log; None (served, and retried on the next
        request) while the database cannot say."""
        try:
            return await asyncio.to_thread(self._usage_since, tenant_id, start, scope.model)
        except Exception as exc:
            log.error("budgets: the audit log cannot be read (%r); not enforced meanwhile", exc)
            return None

    async def _reserve(
        self, keys: list[str], budgets: list[int], tokens: int, *, strict: bool
    ) -> tuple[int | None, list[int]]:
        """``_RESERVE_LUA``'s step, in Redis or here: (None, each count before) when none is
        spent, else (index of the spent counter, the counts); a count of -1: not there, not
        held, and with ``strict`` nothing reserved anywhere."""
        script = self._reserve_script
        if script is not None:
            try:
                result: Any = await asyncio.wait_for(
                    script(keys=keys, args=[tokens, int(strict), *budgets]), self._timeout_s
                )
                if int(result[0]):
                    index = int(result[0]) - 1
                    return index, [int(result[1]) if i == index else 0 for i in range(len(keys))]
                return None, [int(count) for count in result[1:]]
            except Exception as exc:
                if not redis_unreachable(exc):
                    raise
                log.error("budgets: Redis unreachable (%r); counting in this process", exc)
        counts = [self._local.get(key, -1) for key in keys]
        for index, (count, budget) in enumerate(zip(counts, budgets, strict=True)):
            if count >= budget:
                return index, counts
        if strict and min(counts) < 0:
            return None, counts
        for key, count in zip(keys, counts, strict=True):
            if count >= 0:
                self._local[key] = count + tokens
        return None, counts

    async def _add(self, key: str, tokens: int) -> int:
        script = self._charge_script
        if script is not None:
            try:
                result: Any = await asyncio.wait_for(
                    script(keys=[key], args=[tokens]), self._timeout_s
                )
                return int(result)
            except Exception as exc:
                if not redis_unreachable(exc):
                    raise
                log.error("budgets: Redis unreachable (%r); counting in this process", exc)
        if key not in self._local:
            return -1
        self._local[key] += tokens
        return self._local[key]


@dataclass(slots=True)
class BudgetHold:
    """What one admitted request reserved of its budgets: the counters that hold it and how
    many tokens; settled once, after its response (the audit record)."""

    budgets: TokenBudgets
    tenant_id: str
    counters: list[tuple[BudgetScope, str]]
    reserved: int
    header_lines: bytes
    settled: bool = False

    def settle(self, used: int) -> None:
        """Replace the reservation by what the request used (0: it produced nothing); only
        the first call counts."""
        if self.settled:
            return
        self.settled = True
        if self.counters and (used or self.reserved):
            budgets = self.budgets
            budgets._later(
                budgets._settle(self.tenant_id, self.counters, used, used - self.reserved)
            )


def _header_lines(standing: _Standing) -> bytes:
    return (
        b"x-budget-limit-tokens: %d\r\nx-budget-remaining-tokens: %d\r\n"
        b"x-budget-reset: %s\r\nx-budget-scope: %s\r\n"
        % (
            standing.scope.budget.tokens,
            standing.remaining,
            _rfc3339(standing.ends).encode(),
            standing.scope.name.encode(),
        )
    )


def _spent(standing: _Standing, now: datetime) -> APIError:
    budget = standing.scope.budget
    whose = "the tenant's" if standing.scope.model is None else f"{standing.scope.name}'s"
    renews = _rfc3339(standing.ends)
    return APIError(
        429,
        f"Token budget spent: {whose} {budget.tokens} tokens per {budget.period} are used "
        f"({standing.used}); it renews at {renews}.",
        "rate_limit_error",
        "budget_exceeded",
        headers={
            "Retry-After": str(max(1, int((standing.ends - now).total_seconds()) + 1)),
            "x-budget-limit-tokens": str(budget.tokens),
            "x-budget-remaining-tokens": "0",
            "x-budget-reset": renews,
            "x-budget-scope": standing.scope.name,
        },
    )


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
