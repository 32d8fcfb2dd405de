"""A queue in front of one worker pair: who goes next is chosen by tenant, and charged by cost.

The problem: a pair admits whatever fits its KV pool, first come first served, so the tenant
that sends most sets every tenant's latency; and a request is not one unit of work: it may
carry many generations (``n``, ``best_of``, a list of prompts), each a sequence in the
engine's batch with its own prompt and output tokens.

The resources: a grant holds ``slots`` (sequences in the engine's batch: one per generation)
and ``kv`` tokens (what its generations may occupy of the pair's KV pool). At most
``capacity`` slots and ``kv_capacity`` tokens are granted at once; while more than one tenant
holds or wants slots (and for ``linger_s`` after: a tenant at one request in flight is idle
between its requests for a moment only), no slot is granted past ``contended_capacity``:
a request shares the engine's batch with every other one in flight, and on a pair whose step
time grows with its batch a lone tenant's request beside a flood would take the latency of
the whole batch. A grant larger than the cap that holds goes once the pair has drained to
nothing (it is never starved; the caller bounds how large one may be).

No head-of-line wait within a share: a tenant whose slots, this request's included, stay
within its weighted share of the contended cap (``entitlement``) starts at once, past the
contended cap, up to ``capacity + contended_capacity`` (where the two caps differ): it does
not wait for a flooder's long requests to end. The flooder's next request then waits until
the pair is back under the contended cap. The engine is told the same order: each grant
carries an SGLang priority (``engine_priority``), higher for work within its tenant's share.

Who goes next: a request that finds the pair full waits in its tenant's FIFO; when room
frees, the next request goes to the backlogged tenant of the highest priority class whose
virtual start tag is smallest (start-time fair queueing, Goyal et al. 1996). Each tenant's tag
advances by ``cost / weight`` per grant, the cost counted in tokens (the virtual token
counter of Sheng et al., OSDI 2024: ``generation_cost``), so two flooding tenants of weights 2
and 1 are served tokens 2 : 1 whatever the size of their requests. A grant is charged its
reserved cost (every generation's prompt and ``max_tokens``) when it starts, because the order
is decided then and a reservation is the only cost known then; ``Slot.refund`` gives back
what its generations did not produce once they end, so a tenant whose outputs stop early is
not charged for tokens never made. A tenant that was idle starts at the current virtual time
(no credit is banked by staying idle), or at its own last finish tag where that is later (a
debt is kept: one request of many tokens, then a moment idle, does not wipe its cost out).
Priority classes are strict: a lower class is served only while no higher class waits.

A grant leaves the queue as a ``Slot`` (a context manager released on every exit path). A
waiter that is cancelled (its client left) leaves the queue at once and is charged nothing;
one whose wait runs past ``max_wait_s`` is refused with ``WaitExpired``, which says whether its
tenant was holding more than its share of the pair (the caller's 429) or the pair was simply
full (503). Nothing here knows HTTP, the engine or the claims.
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
# Idle tenants' debts kept at most (memory bounded whatever the number of tenants).
_DEBTS_KEPT = 4096

# An output token costs more than a prompt token: each is a decode step of its own, while a
# prompt's tokens are computed together in one prefill (Sheng et al. weigh them 1 and 2).
INPUT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0

# SGLang priorities (larger goes first, SGLang's default direction): the class first, then
# whether the work is within its tenant's share. A handful of values on purpose: SGLang labels
# its metrics by priority. The gap within a class exceeds SGLang's default preemption
# threshold (10), so that where SGLang preempts, work within its share preempts the rest.
ENGINE_CLASS_PRIORITY: dict[Priority, int] = {"high": 300, "normal": 200, "low": 100}
ENGINE_WITHIN_SHARE_BONUS = 50
# What a request sent without a priority (the canary, SGLang's health checks) is given by the
# workers (``--default-priority-value``, gateway.dev.cluster): normal work, beyond its share.
ENGINE_DEFAULT_PRIORITY = ENGINE_CLASS_PRIORITY["normal"]


def generation_cost(prompt_tokens: int, output_tokens: int) -> float:
    """What one generation costs its tenant, in weighted tokens."""
    return INPUT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens


def engine_priority(priority: Priority, within_share: bool) -> int:
    """The SGLang priority of work of ``priority``'s class (see ``ENGINE_CLASS_PRIORITY``)."""
    return ENGINE_CLASS_PRIORITY[priority] + (ENGINE_WITHIN_SHARE_BONUS if within_share else 0)


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
    slots: int
    kv: int
    cost: float
    enqueued_at: float
    # Resolved by ``_dispatch`` when the turn comes; cancelled with its caller's task, or
    # failed with ``_TurnExpired`` by its timer. Either may happen while it is still queued.
    future: asyncio.Future[None]
    granted: bool = False  # a slot was started for it, whatever became of its caller
    priority: int = 0  # the engine priority it was granted with


@dataclass(slots=True)
class _Tenant:
    share: Share
    waiting: deque[_Waiter] = field(default_factory=deque)
    # Virtual time at which this tenant's next request starts (its last finish tag).
    next_start: float = 0.0
    holding: int = 0  # slots held now
    order: int = 0  # tie-break: tenants that became backlogged earlier go first


class Slot:
    """What one grant holds on a pair; ``release`` (or leaving the ``with``) gives it back once.

    ``priority`` is the SGLang priority its work is to be sent with; ``refund`` gives back
    cost charged for tokens its generations did not produce."""

    __slots__ = (
        "_queue",
        "_refundable",
        "_released",
        "_taken_at",
        "_tenant",
        "cost",
        "kv",
        "priority",
        "slots",
    )

    def __init__(
        self,
        queue: FairQueue,
        tenant: _Tenant,
        slots: int,
        kv: int = 0,
        cost: float = 1.0,
        priority: int = ENGINE_DEFAULT_PRIORITY,
    ) -> None:
        self._queue = queue
        self._tenant = tenant
        self.slots = slots
        self.kv = kv
        self.cost = cost
        self.priority = priority
        self._refundable = cost
        self._taken_at = queue.clock()
        self._released = False

    def refund(self, cost: float) -> None:
        """Give back ``cost`` of what this grant was charged (never more than it was)."""
        cost = min(max(0.0, cost), self._refundable)
        if cost:
            self._refundable -= cost
            self._tenant.next_start -= cost / self._tenant.share.weight

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._queue._release(
                self._tenant, self.slots, self.kv, self._queue.clock() - self._taken_at
            )

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class FairQueue:
    """The slots and KV tokens of one worker pair and the tenants waiting for them (see the
    module doc)."""

    def __init__(
        self,
        capacity: int,
        *,
        contended_capacity: int | None = None,
        linger_s: float = 1.0,
        max_queued_per_tenant: int,
        kv_capacity: float = math.inf,
        observer: QueueObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.linger_s = linger_s
        self._contended_until = -math.inf
        self.max_queued_per_tenant = max(0, max_queued_per_tenant)
        self.clock = clock
        self._observer: QueueObserver = observer or _Silent()
        self._tenants: dict[str, _Tenant] = {}
        # The finish tags of idle tenants still ahead of their class's virtual time (their
        # debts); forgotten once the virtual time has passed them.
        self._debts: dict[str, tuple[Priority, float]] = {}
        self._virtual: dict[Priority, float] = dict.fromkeys(PRIORITY_ORDER, 0.0)
        self._in_flight = 0
        self._kv_in_flight = 0
        self._queued = 0
        self._order = itertools.count()
        # Mean time a slot is held (an exponentially weighted average): the Retry-After hint.
        self._mean_hold_s = 1.0
        self.kv_capacity = kv_capacity
        self.set_capacity(capacity, contended_capacity)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def kv_in_flight(self) -> int:
        return self._kv_in_flight

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

    def set_kv_capacity(self, kv_capacity: float) -> None:
        """Adopt a new KV pool size (the engine's report changed)."""
        self.kv_capacity = kv_capacity
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

    def take_free(
        self, share: Share, slots: int = 1, *, kv: int = 0, cost: float = 1.0
    ) -> Slot | None:
        """A grant at once, if there is room for it now and it need not queue; else None
        (``acquire`` waits). Not a coroutine: most requests find room, and take it without a
        frame to resume."""
        # First: a tenant more may make the contended cap hold. (``_tenant`` only when the
        # tenant is new or its share changed: this runs for every request.)
        tenant = self._tenants.get(share.tenant_id)
        if tenant is None or tenant.share is not share:
            tenant = self._tenant(share)
        if tenant.waiting or not (
            # Others queued: only work within its tenant's share goes past them (a newcomer's
            # start tag is the virtual time: at the head of the line anyway).
            self._fits_within_share(tenant, slots, kv)
            if not self._queued
            else self._within_share(tenant, slots, kv)
        ):
            self._forget_if_idle(tenant)  # ``wait_turn`` takes it up again to queue it
            return None
        priority = self._start(tenant, slots, kv, cost, 0.0)
        return Slot(self, tenant, slots, kv, cost, priority)

    async def acquire(
        self, share: Share, max_wait_s: float, slots: int = 1, *, kv: int = 0, cost: float = 1.0
    ) -> Slot:
        """A grant on this pair for work of ``share``'s tenant, waiting at most
        ``max_wait_s``; raises ``WaitExpired``. A cancelled caller (its client left: the HTTP
        layer cancels the request) leaves the queue at once."""
        return self.take_free(share, slots, kv=kv, cost=cost) or await self.wait_turn(
            share, max_wait_s, slots, kv=kv, cost=cost
        )

    async def wait_turn(
        self, share: Share, max_wait_s: float, slots: int = 1, *, kv: int = 0, cost: float = 1.0
    ) -> Slot:
        """``acquire`` once ``take_free`` found no room: queue, and wait for the turn.

        The wait is the future alone, with a timer on it, not ``asyncio.wait``, which builds
        a future, callbacks and two sets per call: under load most requests come this way.
        """
        slots = max(1, slots)
        tenant = self._tenant(share)
        if len(tenant.waiting) >= self.max_queued_per_tenant:
            # As many waiting as a tenant may have is over its share, whatever it holds.
            raise self._refusal(tenant, "tenant_queue_full", over_share=True)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(share, slots, kv, cost, self.clock(), loop.create_future())
        self._enqueue(tenant, waiter)
        timer = None
        if math.isfinite(max_wait_s):
            timer = loop.call_later(max_wait_s, _expire, waiter.future)
        try:
            await waiter.future
        except BaseException as gone:
            if waiter.granted:
                # Granted as the caller went: give it back.
                Slot(self, tenant, slots, kv, cost).release()
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
        return Slot(self, tenant, slots, kv, cost, waiter.priority)

    # -- the schedule -------------------------------------------------------------------------

    def _fits(self, slots: int, kv: int) -> bool:
        """Whether a grant fits under the cap that holds now (one larger than that cap fits
        once nothing else is in flight) and in the KV pool."""
        if self._kv_in_flight + kv > self.kv_capacity:
            return False
        room = self.room()
        return self._in_flight + (slots if slots < room else room) <= room

    def _fits_within_share(self, tenant: _Tenant, slots: int, kv: int) -> bool:
        return self._fits(slots, kv) or self._within_share(tenant, slots, kv)

    def _within_share(self, tenant: _Tenant, slots: int, kv: int) -> bool:
        """Whether the grant goes past the contended cap because the tenant's slots stay within
        its share (see the module doc)."""
        if self.contended_capacity == self.capacity:
            return False  # one cap throughout: nothing to go past
        if self._kv_in_flight + kv > self.kv_capacity:
            return False
        if self._in_flight + slots > self.capacity + self.contended_capacity:
            return False
        return tenant.holding + slots <= self._entitlement(tenant)

    def _entitlement(self, tenant: _Tenant) -> int:
        """The slots of the contended cap that are the tenant's weighted share among the
        tenants of its class that hold or want slots (at least one; none while a higher
        class holds or wants any)."""
        rank = PRIORITY_ORDER.index(tenant.share.priority)
        total = tenant.share.weight
        for other in self._tenants.values():
            if other is tenant or not (other.waiting or other.holding):
                continue
            other_rank = PRIORITY_ORDER.index(other.share.priority)
            if other_rank < rank:
                return 0
            if other_rank == rank:
                total += other.share.weight
        return max(1, int(self.contended_capacity * tenant.share.weight / total))

    def _tenant(self, share: Share) -> _Tenant:
        tenant = self._tenants.get(share.tenant_id)
        if tenant is None:
            tenant = self._tenants[share.tenant_id] = _Tenant(share)
            if self._debts:
                debt = self._debts.pop(share.tenant_id, None)
                if debt is not None and debt[0] == share.priority:
                    tenant.next_start = debt[1]
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

    def _start(self, tenant: _Tenant, slots: int, kv: int, cost: float, waited_s: float) -> int:
        """Charge ``tenant`` for a grant now going to the pair; its engine priority."""
        share, virtual = tenant.share, self._virtual
        # Within its share of the contended cap, this grant included (a lone tenant's share
        # is the whole contended cap: its work past that is the first to give way).
        if len(self._tenants) == 1:
            within = tenant.holding + slots <= self.contended_capacity
        else:
            within = tenant.holding + slots <= self._entitlement(tenant)
        # The later of its own next start and the class's virtual time (``max`` written out).
        start, now = tenant.next_start, virtual[share.priority]
        if start < now:
            start = now
        virtual[share.priority] = start
        tenant.next_start = start + cost / share.weight
        tenant.holding += slots
        self._in_flight += slots
        self._kv_in_flight += kv
        self._observer.started(share.tenant_id, waited_s)
        return engine_priority(share.priority, within)

    def _release(self, tenant: _Tenant, slots: int, kv: int, held_s: float) -> None:
        self._in_flight -= slots
        self._kv_in_flight -= kv
        tenant.holding -= slots
        self._mean_hold_s += 0.2 * (held_s - self._mean_hold_s)
        if tenant.holding == 0:  # else it is not idle (``_forget_if_idle`` checks the rest)
            self._forget_if_idle(tenant)
        if self._queued:  # most releases find nobody waiting
            self._dispatch()

    def _forget_if_idle(self, tenant: _Tenant) -> None:
        # An idle tenant holds no state worth keeping but its debt: on return it starts at the
        # virtual time, or at its finish tag if that is later.
        if not tenant.waiting and tenant.holding == 0:
            tenant_id = tenant.share.tenant_id
            if self._tenants.pop(tenant_id, None) is None:
                return
            priority = tenant.share.priority
            if tenant.next_start > self._virtual[priority]:
                if len(self._debts) >= _DEBTS_KEPT:
                    self._forget_paid_debts()
                self._debts[tenant_id] = (priority, tenant.next_start)

    def _forget_paid_debts(self) -> None:
        virtual = self._virtual
        self._debts = {
            tenant_id: (priority, tag)
            for tenant_id, (priority, tag) in self._debts.items()
            if tag > virtual[priority]
        }
        while len(self._debts) >= _DEBTS_KEPT:  # still as many: the oldest go first
            del self._debts[next(iter(self._debts))]

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
            if not leaving and not self._fits_within_share(tenant, waiter.slots, waiter.kv):
                return  # the head waits for room; nobody overtakes it (no starvation by size)
            tenant.waiting.popleft()
            self._queued -= 1
            self._observer.queued(tenant.share.tenant_id, -1)
            if leaving:
                continue
            waiter.priority = self._start(
                tenant, waiter.slots, waiter.kv, waiter.cost, self.clock() - waiter.enqueued_at
            )
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
