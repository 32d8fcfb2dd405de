"""A queue in front of one worker pair: who goes next is chosen by tenant, not by arrival.

The problem: a pair admits whatever fits its KV pool, first come first served, so the tenant
that sends most sets every tenant's latency. Past the point where the engine's throughput
stops growing, more requests in flight only make every request slower.

The invariant: at most ``capacity`` slots of a pair are held at once, and no slot is granted
past ``contended_capacity`` while more than one tenant holds or wants slots (nor for
``linger_s`` after: a tenant at one request in flight is idle between its requests for a
moment only; slots already held are not taken back). The first cap is where the pair's
throughput stops growing; the second one is lower, because a request shares the engine's
batch with every other one in flight, and on a pair whose step time grows with its batch a
lone tenant's request beside a flooding tenant's would take the latency of the whole batch.

A request that finds the pair full waits in its tenant's FIFO; when a slot frees, the next
request goes to the backlogged tenant of the highest priority class whose virtual start tag
is smallest (start-time fair queueing, Goyal et al. 1996): each tenant's tag advances by
``cost / weight`` per request it is served, so two flooding tenants of weights 2 and 1 are
served 2 : 1, and a tenant that was idle starts at the current virtual time (no credit is
banked by staying idle). Priority classes are strict: a lower class is served only while no
higher class waits.

A request leaves the queue *holding* its slot (``Slot``, a context manager released on every
exit path). A waiter that is cancelled (its client left) leaves the queue at once and is
charged nothing; one whose wait runs past ``max_wait_s`` is refused with ``WaitExpired``,
which says whether its tenant was holding more than its share of the pair (the caller's 429)
or the pair was simply full (503). Nothing here knows HTTP, the engine or the claims.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config.policies import Priority, Share

PRIORITY_ORDER: tuple[Priority, ...] = ("high", "normal", "low")


class WaitExpired(Exception):
    """A queued request waited its whole ``max_wait_s`` (or its tenant's queue was full).

    ``over_share``: the tenant held at least its weighted share of the pair's slots, so the
    refusal is the tenant's (429); otherwise the pair is full for everyone (503).
    """

    def __init__(self, over_share: bool, retry_after_s: float, reason: str) -> None:
        super().__init__(reason)
        self.over_share = over_share
        self.retry_after_s = retry_after_s
        self.reason = reason


class _TurnExpired(Exception):
    """Set on a waiter's future when its ``max_wait_s`` runs out before its turn came."""


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(_TurnExpired())


class QueueObserver(Protocol):
    """What the queue reports, for metrics; every call is cheap and synchronous."""

    def queued(self, tenant_id: str, change: int) -> None: ...

    def started(self, tenant_id: str, waited_s: float) -> None:
        """One request of the tenant got its slot, after waiting ``waited_s`` in the queue."""

    def refused(self, tenant_id: str, reason: str) -> None: ...


class _Silent:
    def queued(self, tenant_id: str, change: int) -> None:
        pass

    def started(self, tenant_id: str, waited_s: float) -> None:
        pass

    def refused(self, tenant_id: str, reason: str) -> None:
        pass


@dataclass(eq=False, slots=True)
class _Waiter:
    share: Share
    cost: int
    enqueued_at: float
    # Resolved by ``_dispatch`` when the turn comes; cancelled with its caller's task, or
    # failed with ``_TurnExpired`` by its timer. Either may happen while it is still queued.
    future: asyncio.Future[None]
    granted: bool = False  # a slot was started for it, whatever became of its caller


@dataclass(slots=True)
class _Tenant:
    share: Share
    waiting: deque[_Waiter] = field(default_factory=deque)
    # Virtual time at which this tenant's next request starts (its last finish tag).
    next_start: float = 0.0
    holding: int = 0  # slots held now
    order: int = 0  # tie-break: tenants that became backlogged earlier go first


class Slot:
    """Slots held on one pair; ``release`` (or leaving the ``with``) gives them back once."""

    __slots__ = ("_queue", "_released", "_taken_at", "_tenant", "cost")

    def __init__(self, queue: FairQueue, tenant: _Tenant, cost: int) -> None:
        self._queue = queue
        self._tenant = tenant
        self.cost = cost
        self._taken_at = queue.clock()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._queue._release(self._tenant, self.cost, self._queue.clock() - self._taken_at)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class FairQueue:
    """The slots of one worker pair and the tenants waiting for them (see the module doc)."""

    def __init__(
        self,
        capacity: int,
        *,
        contended_capacity: int | None = None,
        linger_s: float = 1.0,
        max_queued_per_tenant: int,
        observer: QueueObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.linger_s = linger_s
        self._contended_until = -math.inf
        self.max_queued_per_tenant = max(0, max_queued_per_tenant)
        self.clock = clock
        self._observer: QueueObserver = observer or _Silent()
        self._tenants: dict[str, _Tenant] = {}
        self._virtual: dict[Priority, float] = dict.fromkeys(PRIORITY_ORDER, 0.0)
        self._in_flight = 0
        self._queued = 0
        self._order = itertools.count()
        # Mean time a slot is held (an exponentially weighted average): the Retry-After hint.
        self._mean_hold_s = 1.0
        self.set_capacity(capacity, contended_capacity)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    def queued_of(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        return len(tenant.waiting) if tenant else 0

    def holding_of(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        return tenant.holding if tenant else 0

    def set_capacity(self, capacity: int, contended_capacity: int | None = None) -> None:
        """Adopt new caps (the engine's report or the policy changed); a larger one lets
        waiters go at once. No contended cap, or one above ``capacity``: ``capacity``."""
        self.capacity = max(1, capacity)
        contended = self.capacity if contended_capacity is None else contended_capacity
        self.contended_capacity = max(1, min(contended, self.capacity))
        self._dispatch()

    def room(self) -> int:
        """The cap that holds now (see the module doc)."""
        if self.contended_capacity == self.capacity:
            return self.capacity
        if len(self._tenants) > 1:  # only tenants that hold or want slots are kept
            self._contended_until = self.clock() + self.linger_s
            return self.contended_capacity
        if self._contended_until > self.clock():
            return self.contended_capacity
        return self.capacity

    def take_free(self, share: Share, cost: int = 1) -> Slot | None:
        """A slot at once, if nobody waits and there is room; else None (``acquire`` waits).
        Not a coroutine: most requests find room, and take it without a frame to resume."""
        # Never more than the smaller cap, or a request could wait for room that never comes
        # (a cost of one never is: both caps are at least one).
        if cost != 1:
            cost = min(max(1, cost), self.contended_capacity)
        # First: a tenant more may make the contended cap hold. (``_tenant`` only when the
        # tenant is new or its share changed: this runs for every request.)
        tenant = self._tenants.get(share.tenant_id)
        if tenant is None or tenant.share is not share:
            tenant = self._tenant(share)
        if self._queued or self._in_flight + cost > self.room():
            self._forget_if_idle(tenant)  # ``wait_turn`` takes it up again to queue it
            return None
        self._start(tenant, cost, 0.0)
        return Slot(self, tenant, cost)

    async def acquire(self, share: Share, max_wait_s: float, cost: int = 1) -> Slot:
        """A slot on this pair for one request of ``share``'s tenant, waiting at most
        ``max_wait_s``; raises ``WaitExpired``. A cancelled caller (its client left: the HTTP
        layer cancels the request) leaves the queue at once."""
        return self.take_free(share, cost) or await self.wait_turn(share, max_wait_s, cost)

    async def wait_turn(self, share: Share, max_wait_s: float, cost: int = 1) -> Slot:
        """``acquire`` once ``take_free`` found no slot: queue, and wait for the turn.

        The wait is the future alone, with a timer on it, not ``asyncio.wait``, which builds
        a future, callbacks and two sets per call: under load most requests come this way.
        """
        cost = min(max(1, cost), self.contended_capacity)
        tenant = self._tenant(share)
        if len(tenant.waiting) >= self.max_queued_per_tenant:
            # As many waiting as a tenant may have is over its share, whatever it holds.
            raise self._refusal(tenant, "tenant_queue_full", over_share=True)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(share, cost, self.clock(), loop.create_future())
        self._enqueue(tenant, waiter)
        timer = None
        if math.isfinite(max_wait_s):
            timer = loop.call_later(max_wait_s, _expire, waiter.future)
        try:
            await waiter.future
        except BaseException as gone:
            if waiter.granted:
                Slot(self, tenant, cost).release()  # granted as the caller went: give it back
                raise
            expired = isinstance(gone, _TurnExpired)
            self._leave(tenant, waiter, refusing=expired)
            if expired:
                raise self._refusal(tenant, "wait_expired") from None
            if isinstance(gone, asyncio.CancelledError):
                self._observer.refused(share.tenant_id, "abandoned")
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Slot(self, tenant, cost)

    # -- the schedule -------------------------------------------------------------------------

    def _tenant(self, share: Share) -> _Tenant:
        tenant = self._tenants.get(share.tenant_id)
        if tenant is None:
            tenant = self._tenants[share.tenant_id] = _Tenant(share)
        elif tenant.share is not share:
            # Policies give one share per tenant (``Policies.share``): another one means a
            # reload, which may have changed its weight or class.
            tenant.share = share
        return tenant

    def _enqueue(self, tenant: _Tenant, waiter: _Waiter) -> None:
        if not tenant.waiting:
            # Newly backlogged: it starts now, whatever it was owed before it went idle.
            priority = tenant.share.priority
            tenant.next_start = max(tenant.next_start, self._virtual[priority])
            tenant.order = next(self._order)
        tenant.waiting.append(waiter)
        self._queued += 1
        self._observer.queued(tenant.share.tenant_id, 1)

    def _leave(self, tenant: _Tenant, waiter: _Waiter, *, refusing: bool = False) -> None:
        waiter.future.cancel()
        try:
            tenant.waiting.remove(waiter)
        except ValueError:
            queued = False  # ``_dispatch`` found it leaving and took it out already
        else:
            queued = True
            self._queued -= 1
            self._observer.queued(tenant.share.tenant_id, -1)
        if not refusing:  # a refusal still needs the tenant's standing to say 429 or 503
            self._forget_if_idle(tenant)
        if queued:
            # The head of the queue may have been waiting for the slots this one would have
            # taken.
            self._dispatch()

    def _start(self, tenant: _Tenant, cost: int, waited_s: float) -> None:
        """Charge ``tenant`` for one request now going to the pair."""
        share, virtual = tenant.share, self._virtual
        # The later of its own next start and the class's virtual time (``max`` written out).
        start, now = tenant.next_start, virtual[share.priority]
        if start < now:
            start = now
        virtual[share.priority] = start
        tenant.next_start = start + cost / share.weight
        tenant.holding += cost
        self._in_flight += cost
        self._observer.started(share.tenant_id, waited_s)

    def _release(self, tenant: _Tenant, cost: int, held_s: float) -> None:
        self._in_flight -= cost
        tenant.holding -= cost
        self._mean_hold_s += 0.2 * (held_s - self._mean_hold_s)
        if tenant.holding == 0:  # else it is not idle (``_forget_if_idle`` checks the rest)
            self._forget_if_idle(tenant)
        if self._queued:  # most releases find nobody waiting
            self._dispatch()

    def _forget_if_idle(self, tenant: _Tenant) -> None:
        # An idle tenant holds no state worth keeping: on return it starts at the virtual time.
        if not tenant.waiting and tenant.holding == 0:
            self._tenants.pop(tenant.share.tenant_id, None)

    def _next(self) -> _Tenant | None:
        """The backlogged tenant that goes next: highest class, then smallest start tag."""
        best: tuple[int, float, int] | None = None
        chosen = None
        for tenant in self._tenants.values():
            if not tenant.waiting:
                continue
            key = (
                PRIORITY_ORDER.index(tenant.share.priority),
                max(tenant.next_start, self._virtual[tenant.share.priority]),
                tenant.order,
            )
            if best is None or key < best:
                best, chosen = key, tenant
        return chosen

    def _dispatch(self) -> None:
        while self._queued:
            tenant = self._next()
            if tenant is None:
                return
            waiter = tenant.waiting[0]
            leaving = waiter.future.done()  # cancelled or expired, its caller not yet run
            if not leaving and self._in_flight + waiter.cost > self.room():
                return  # the head waits for room; nobody overtakes it (no starvation by size)
            tenant.waiting.popleft()
            self._queued -= 1
            self._observer.queued(tenant.share.tenant_id, -1)
            if leaving:
                continue
            self._start(tenant, waiter.cost, self.clock() - waiter.enqueued_at)
            waiter.granted = True
            waiter.future.set_result(None)

    def _refusal(self, tenant: _Tenant, reason: str, *, over_share: bool = False) -> WaitExpired:
        self._observer.refused(tenant.share.tenant_id, reason)
        over_share = over_share or self._over_share(tenant)
        self._forget_if_idle(tenant)
        return WaitExpired(over_share, self._retry_after_s(), reason)

    def _over_share(self, tenant: _Tenant) -> bool:
        """Whether the tenant holds at least its weighted share of the slots, among the
        tenants of its class that hold or want slots now."""
        priority = tenant.share.priority
        others = sum(
            t.share.weight
            for t in self._tenants.values()
            if t is not tenant and t.share.priority == priority and (t.waiting or t.holding)
        )
        total = others + tenant.share.weight
        fair = self.room() * tenant.share.weight / total
        return tenant.holding >= fair

    def _retry_after_s(self) -> float:
        """When a slot is likely to be free for a newcomer: the queue ahead, drained at
        ``capacity`` slots per mean hold time."""
        return max(1.0, min(60.0, self._mean_hold_s * (self._queued + 1) / self.room()))
