"""The fair queue's order and shares, bounded wait and exits (gateway.core.fair_queue, pair_queues).

Deterministic: the slots of a saturated queue are handed out one release at a time and the
order of service is read back; nothing here depends on how fast anything runs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.policies import DecodeWorker, PolicyError, PrefillWorker, Share, load_policies
from gateway.core.fair_queue import (
    ENGINE_DEFAULT_PRIORITY,
    FairQueue,
    Slot,
    WaitExpired,
    engine_priority,
    generation_cost,
)
from gateway.core.pair_queues import (
    PairQueues,
    QueueSettings,
    RequestBound,
    pair_cap,
    queue_refusal,
)
from gateway.observability.metrics import Metrics
from gateway.workers.capacity import WorkerCapacity
from gateway.workers.pairs import WorkerPair
from tests.harness import PoolSpec, write_policies

FOREVER = float("inf")


async def _serve_in_order(
    queue: FairQueue, requests: list[Share], *, served: int | None = None
) -> list[str]:
    """Queue ``requests`` (in this order) behind a saturated queue, then free one slot at a time
    and return the tenants in the order they were served (the first ``served`` of them)."""
    blockers = [await queue.acquire(Share("blocker"), FOREVER) for _ in range(queue.capacity)]
    order: list[str] = []
    slots: asyncio.Queue[Slot] = asyncio.Queue()

    async def one(share: Share) -> None:
        slot = await queue.acquire(share, FOREVER)
        order.append(share.tenant_id)
        await slots.put(slot)

    tasks = [asyncio.ensure_future(one(share)) for share in requests]
    await asyncio.sleep(0)  # every request is queued, in list order
    assert queue.queued == len(requests)
    for blocker in blockers:
        blocker.release()
    for _ in range(served if served is not None else len(requests)):
        (await slots.get()).release()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order[: served if served is not None else len(requests)]


def test_weights_two_to_one_are_served_two_to_one_while_both_flood() -> None:
    heavy, light = Share("a", weight=2), Share("b", weight=1)
    order = asyncio.run(
        _serve_in_order(
            FairQueue(1, max_queued_per_tenant=100), [heavy] * 40 + [light] * 40, served=30
        )
    )
    assert Counter(order) == {"a": 20, "b": 10}


def test_a_tenant_arriving_behind_a_flood_is_served_next_not_after_it() -> None:
    order = asyncio.run(
        _serve_in_order(FairQueue(1, max_queued_per_tenant=100), [Share("a")] * 10 + [Share("b")])
    )
    assert order.index("b") <= 1
    # First come first served would have put b last.
    assert order[-1] == "a"


def test_equal_weights_alternate() -> None:
    order = asyncio.run(
        _serve_in_order(
            FairQueue(1, max_queued_per_tenant=100), [Share("a")] * 6 + [Share("b")] * 6
        )
    )
    assert order == ["a", "b"] * 6


def test_a_higher_priority_class_goes_first_whatever_the_weights() -> None:
    requests = (
        [Share("bulk", weight=100, priority="low")] * 3
        + [Share("std", weight=1)] * 3
        + [Share("vip", priority="high")] * 3
    )
    order = asyncio.run(_serve_in_order(FairQueue(1, max_queued_per_tenant=100), requests))
    assert order == ["vip"] * 3 + ["std"] * 3 + ["bulk"] * 3


def test_an_idle_tenant_banks_no_credit() -> None:
    async def scenario() -> list[str]:
        queue = FairQueue(1, max_queued_per_tenant=1000)
        # b alone is served 50 times while a is idle...
        for _ in range(50):
            (await queue.acquire(Share("b"), FOREVER)).release()
        # ...then both flood: a does not get 50 turns in a row for having been away.
        return await _serve_in_order(queue, [Share("a")] * 10 + [Share("b")] * 10)

    order = asyncio.run(scenario())
    assert order[:4].count("b") >= 1
    # Level within one request: b's last finish tag (one request ahead of the virtual time) is
    # kept as its debt, not its fifty requests.
    assert Counter(order[:10])["a"] in (5, 6), order


def test_a_request_of_several_generations_takes_as_many_slots() -> None:
    async def scenario() -> None:
        queue = FairQueue(4, max_queued_per_tenant=10)
        three = await queue.acquire(Share("a"), FOREVER, slots=3)
        assert queue.in_flight == 3 and queue.holding_of("a") == 3
        waiting = asyncio.ensure_future(queue.acquire(Share("b"), FOREVER, slots=2))
        await asyncio.sleep(0)
        assert not waiting.done() and queue.queued == 1
        three.release()
        two = await waiting
        assert queue.in_flight == 2
        two.release()
        # More than the whole pair goes once the pair has drained (never refused forever),
        # and is counted as what it is: 99 slots, not the cap.
        big = await queue.acquire(Share("a"), FOREVER, slots=99)
        assert queue.in_flight == 99
        big.release()
        assert queue.in_flight == 0

    asyncio.run(scenario())


def test_slots_are_released_once_on_every_exit() -> None:
    async def scenario() -> None:
        queue = FairQueue(2, max_queued_per_tenant=10)
        with await queue.acquire(Share("a"), FOREVER) as slot:
            assert queue.in_flight == 1
        slot.release()  # a second release gives nothing back twice
        assert queue.in_flight == 0
        with pytest.raises(RuntimeError), await queue.acquire(Share("a"), FOREVER):
            raise RuntimeError("the request failed")
        assert queue.in_flight == 0 and queue.holding_of("a") == 0

    asyncio.run(scenario())


def test_a_wait_past_max_wait_is_refused_and_leaves_the_queue() -> None:
    async def scenario() -> None:
        queue = FairQueue(2, max_queued_per_tenant=10)
        held = [await queue.acquire(Share("a"), FOREVER) for _ in range(2)]
        # a holds the whole pair: its next request is over its share (429).
        with pytest.raises(WaitExpired) as over:
            await queue.acquire(Share("a"), 0.01)
        assert over.value.over_share and over.value.retry_after_s >= 1
        # b holds nothing: it is refused because the pair is full (503).
        with pytest.raises(WaitExpired) as full:
            await queue.acquire(Share("b"), 0.01)
        assert not full.value.over_share
        assert queue.queued == 0 and queue.in_flight == 2
        for slot in held:
            slot.release()
        assert queue.in_flight == 0

    asyncio.run(scenario())


def test_the_share_a_refusal_weighs_counts_the_weights_of_those_waiting() -> None:
    async def scenario() -> tuple[bool, bool]:
        queue = FairQueue(3, max_queued_per_tenant=10)
        # a (weight 2) holds 2 of 3 slots, b (weight 1) holds 1: each exactly its share.
        held = [await queue.acquire(Share("a", weight=2), FOREVER) for _ in range(2)]
        held.append(await queue.acquire(Share("b"), FOREVER))
        results = []
        for share in (Share("a", weight=2), Share("b")):
            try:
                await queue.acquire(share, 0.01)
            except WaitExpired as expired:
                results.append(expired.over_share)
        for slot in held:
            slot.release()
        return results[0], results[1]

    assert asyncio.run(scenario()) == (True, True)


def test_a_tenant_with_a_full_queue_is_refused_at_once() -> None:
    async def scenario() -> None:
        queue = FairQueue(1, max_queued_per_tenant=1)
        slot = await queue.acquire(Share("a"), FOREVER)
        first = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER))
        await asyncio.sleep(0)
        with pytest.raises(WaitExpired) as refused:
            await queue.acquire(Share("a"), FOREVER)
        assert refused.value.reason == "tenant_queue_full" and refused.value.over_share
        slot.release()
        (await first).release()

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_at_once_and_is_charged_nothing() -> None:
    async def scenario() -> list[str]:
        queue = FairQueue(1, max_queued_per_tenant=100)
        slot = await queue.acquire(Share("x"), FOREVER)
        gone = [asyncio.ensure_future(queue.acquire(Share("a"), FOREVER)) for _ in range(5)]
        await asyncio.sleep(0)
        assert queue.queued_of("a") == 5
        for task in gone:
            task.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        assert queue.queued == 0
        slot.release()
        assert queue.in_flight == 0
        # The five that left cost a nothing: it and b alternate from the start.
        return await _serve_in_order(queue, [Share("b")] * 3 + [Share("a")] * 3)

    assert asyncio.run(scenario()) == ["b", "a"] * 3


def test_a_waiter_whose_caller_is_cancelled_leaves_the_queue_at_once() -> None:
    """The HTTP layer cancels a request whose client left; queued, it is gone at once, and
    the one behind it moves up."""

    class Refusals:
        def __init__(self) -> None:
            self.reasons: list[str] = []

        def queued(self, tenant_id: str, delta: int) -> None: ...
        def started(self, tenant_id: str, waited_s: float) -> None: ...
        def refused(self, tenant_id: str, reason: str) -> None:
            self.reasons.append(reason)

    async def scenario() -> None:
        observer = Refusals()
        queue = FairQueue(1, max_queued_per_tenant=10, observer=observer)
        slot = await queue.acquire(Share("x"), FOREVER)
        leaving = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER))
        staying = asyncio.ensure_future(queue.acquire(Share("b"), FOREVER))
        await asyncio.sleep(0)
        assert queue.queued == 2
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert queue.queued == 1 and observer.reasons == ["abandoned"]
        slot.release()
        (await staying).release()
        assert queue.in_flight == 0 and queue.queued == 0

    asyncio.run(scenario())


def test_a_slot_granted_as_its_waiter_is_cancelled_is_given_back() -> None:
    async def scenario() -> None:
        queue = FairQueue(1, max_queued_per_tenant=10)
        slot = await queue.acquire(Share("x"), FOREVER)
        waiting = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER))
        await asyncio.sleep(0)
        slot.release()  # grants the slot to the waiter...
        waiting.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert queue.in_flight == 0 and queue.holding_of("a") == 0

    asyncio.run(scenario())


def test_a_slot_freed_while_a_cancelled_waiter_is_leaving_goes_to_the_next_in_line() -> None:
    async def scenario() -> None:
        # Contended (several tenants): one slot; one tenant alone: two.
        queue = FairQueue(2, contended_capacity=1, linger_s=0.0, max_queued_per_tenant=10)
        # Three slots: past what a tenant within its share may go past (cap + contended cap).
        slot = await queue.acquire(Share("x"), FOREVER, slots=3)
        leaving = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER))
        await asyncio.sleep(0)
        staying = asyncio.ensure_future(queue.acquire(Share("b"), FOREVER))
        await asyncio.sleep(0)
        assert queue.queued == 2
        leaving.cancel()  # its caller has not run since...
        slot.release()  # ...when the slot frees
        with pytest.raises(asyncio.CancelledError):
            await leaving
        kept = await asyncio.wait_for(staying, 1.0)
        assert queue.in_flight == 1 and queue.holding_of("b") == 1 and queue.queued == 0
        assert queue.holding_of("a") == 0 and queue.queued_of("a") == 0
        kept.release()
        # Nobody was left behind: a tenant alone has the whole pair again.
        alone = [queue.take_free(Share("c")) for _ in range(2)]
        assert all(alone) and queue.in_flight == 2

    asyncio.run(scenario())


def test_a_wait_that_expires_as_a_slot_frees_is_refused_and_the_slot_goes_on() -> None:
    async def scenario() -> None:
        queue = FairQueue(1, max_queued_per_tenant=10)
        slot = await queue.acquire(Share("x"), FOREVER)
        expiring = asyncio.ensure_future(queue.acquire(Share("a"), 0.05))
        await asyncio.sleep(0)
        staying = asyncio.ensure_future(queue.acquire(Share("b"), FOREVER))
        await asyncio.sleep(0.2)  # a's wait has run out; b's has not
        slot.release()
        with pytest.raises(WaitExpired):
            await expiring
        (await asyncio.wait_for(staying, 1.0)).release()
        assert queue.in_flight == 0 and queue.queued == 0
        assert queue.holding_of("a") == 0 and queue.queued_of("a") == 0

    asyncio.run(scenario())


def test_a_larger_cap_lets_waiters_go_at_once() -> None:
    async def scenario() -> None:
        queue = FairQueue(1, max_queued_per_tenant=10)
        slot = await queue.acquire(Share("x"), FOREVER)
        waiting = [asyncio.ensure_future(queue.acquire(Share(t), FOREVER)) for t in ("a", "b")]
        await asyncio.sleep(0)
        assert queue.queued == 2 and not any(w.done() for w in waiting)
        queue.set_capacity(3)
        # Without any slot released: both waiters hold theirs once they have run.
        done, _ = await asyncio.wait(waiting, timeout=5)
        assert done == set(waiting), "a waiter still waits after the cap grew"
        assert queue.queued == 0 and queue.in_flight == 3
        for w in waiting:
            w.result().release()
        slot.release()

    asyncio.run(scenario())


def test_replicas_each_holding_their_part_stay_within_the_cap_and_keep_the_shares() -> None:
    """Two replicas, each ceil(cap / 2) of a pair, a load balancer alternating each tenant's
    requests between them: all together hold at most the cap and serve 2 : 1."""
    cap = 4
    part = pair_cap(None, cap, (None, None), replicas=2)
    assert part == 2

    async def scenario() -> Counter[str]:
        replicas = [FairQueue(part, max_queued_per_tenant=100) for _ in range(2)]
        heavy, light = Share("a", weight=2), Share("b", weight=1)
        blockers = [
            await r.acquire(Share("blocker"), FOREVER) for r in replicas for _ in range(part)
        ]
        order: list[str] = []
        slots: asyncio.Queue[Slot] = asyncio.Queue()

        async def one(replica: FairQueue, share: Share) -> None:
            slot = await replica.acquire(share, FOREVER)
            order.append(share.tenant_id)
            assert sum(r.in_flight for r in replicas) <= cap
            await slots.put(slot)

        tasks = [
            asyncio.ensure_future(one(replicas[i % 2], share))
            for share in (heavy, light)
            for i in range(40)
        ]
        await asyncio.sleep(0)
        for blocker in blockers:
            blocker.release()
        for _ in range(30):
            (await slots.get()).release()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return Counter(order[:30])

    served = asyncio.run(scenario())
    assert served["a"] == pytest.approx(2 * served["b"], rel=0.15)


def test_the_cap_is_the_policy_else_the_least_of_the_setting_and_the_engines() -> None:
    assert pair_cap(None, 8, (2048, 2048)) == 8
    assert pair_cap(None, 8, (4, None)) == 4
    assert pair_cap(12, 8, (4, 4)) == 12  # the platform team's override wins
    assert pair_cap(None, 8, (None, None), replicas=3) == 3
    assert pair_cap(None, 1, (None, None), replicas=4) == 1


async def _settle() -> None:
    """Let every task that can run, run (a granted waiter takes a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_tenant_may_fill_the_whole_cap() -> None:
    async def scenario() -> int:
        queue = FairQueue(4, contended_capacity=1, max_queued_per_tenant=10)
        slots = [await queue.acquire(Share("a"), 0.01) for _ in range(4)]
        with pytest.raises(WaitExpired):
            await queue.acquire(Share("a"), 0.01)
        held = queue.in_flight
        for slot in slots:
            slot.release()
        return held

    assert asyncio.run(scenario()) == 4


def test_a_tenant_within_its_share_starts_at_once_and_the_flood_waits_for_the_contended_cap() -> (
    None
):
    """No head-of-line wait: B arrives while A holds the whole pair, and starts without waiting
    for any of A's requests to end; A's next request waits until the pair is back under the
    contended cap. Past the cap by at most the contended cap: a third newcomer goes, a fourth
    waits until one ends."""

    async def scenario() -> list[tuple[str, int]]:
        queue = FairQueue(4, contended_capacity=2, max_queued_per_tenant=10, clock=_Clock())
        a_slots = [await queue.acquire(Share("a"), FOREVER) for _ in range(4)]
        # A alone: the first two within the contended cap, its share; the rest beyond it.
        assert [slot.priority for slot in a_slots] == [250, 250, 200, 200]
        granted: list[tuple[str, int]] = []

        async def one(share: Share) -> Slot:
            slot = await queue.acquire(share, FOREVER)
            granted.append((share.tenant_id, queue.in_flight))
            return slot

        b = asyncio.ensure_future(one(Share("b")))
        await _settle()
        assert granted == [("b", 5)]  # at once, beside A's four
        assert (await b).priority == 250  # within its share: ahead of A's excess in the engine
        a_more = asyncio.ensure_future(one(Share("a")))
        c = asyncio.ensure_future(one(Share("c")))
        d = asyncio.ensure_future(one(Share("d")))
        await _settle()
        assert granted == [("b", 5), ("c", 6)]  # d would be past cap + contended cap
        a_slots[0].release()
        await _settle()
        assert granted[2:] == [("d", 6)]  # d, within its share, as soon as that is not
        for slot in a_slots[1:3]:  # A's next: not while A holds more than its share
            slot.release()
            await _settle()
        assert len(granted) == 3
        a_slots[3].release()  # A within its share again: one each, for four tenants
        await _settle()
        for waiter in (b, c, d, a_more):
            (await waiter).release()
        return granted

    assert asyncio.run(scenario()) == [("b", 5), ("c", 6), ("d", 6), ("a", 4)]


def test_the_contended_cap_lingers_after_the_other_tenant_goes_idle_then_lifts() -> None:
    async def scenario() -> None:
        clock = _Clock()
        queue = FairQueue(
            4, contended_capacity=1, linger_s=1.0, max_queued_per_tenant=10, clock=clock
        )
        b = await queue.acquire(Share("b"), 0)
        a = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER))
        await asyncio.sleep(0)
        b.release()  # B is idle between two of its requests
        first_a = await a
        assert queue.room() == 1
        with pytest.raises(WaitExpired):  # within linger_s of the contention: still capped
            await queue.acquire(Share("a"), 0.01)
        clock.now = 1.5
        second_a = await queue.acquire(Share("a"), 0.01)  # a lone tenant again: the whole cap
        assert queue.room() == 4 and queue.in_flight == 2
        first_a.release()
        second_a.release()

    asyncio.run(scenario())


def test_a_contended_cap_above_the_cap_is_the_cap() -> None:
    queue = FairQueue(3, contended_capacity=8, max_queued_per_tenant=1)
    assert (queue.capacity, queue.contended_capacity) == (3, 3)
    queue.set_capacity(6, 2)
    assert (queue.capacity, queue.contended_capacity) == (6, 2)


def _pair(max_running: int | None) -> WorkerPair:
    def state(url: str, role: Any) -> WorkerCapacity:
        return WorkerCapacity(url, role, 0.0, 1000, None, None, 1, 0, None, max_running)

    prefill, decode = (
        PrefillWorker(url="http://p:1", bootstrap_port=2),
        DecodeWorker(url="http://d:1"),
    )
    return WorkerPair(
        "shared", prefill, decode, state(prefill.url, "prefill"), state(decode.url, "decode")
    )


def test_both_caps_come_from_the_pool_else_the_settings_and_the_contended_never_exceeds_the_cap(
    tmp_path: Path,
) -> None:
    directory = _policies_with(tmp_path, {})
    model = load_policies(directory).models["m"]
    settings = QueueSettings(12, 10.0, 10, default_in_flight_contended=3)
    queues = PairQueues(settings, Metrics())
    assert queues.caps_of(model, _pair(None)) == (12, 3)
    assert queues.caps_of(model, _pair(2)) == (2, 2)  # the engine's own limit bounds both
    models = yaml.safe_load((directory / "models.yaml").read_text())
    pool = models["models"][0]["pools"][0]
    pool.update(max_in_flight_per_pair=6, max_in_flight_per_pair_contended=9)
    (directory / "models.yaml").write_text(yaml.safe_dump(models))
    reloaded = load_policies(directory).models["m"]
    assert queues.caps_of(reloaded, _pair(None)) == (6, 6)  # never above the cap
    pool.update(max_in_flight_per_pair_contended=4)
    (directory / "models.yaml").write_text(yaml.safe_dump(models))
    assert queues.caps_of(load_policies(directory).models["m"], _pair(None)) == (6, 4)
    del pool["max_in_flight_per_pair_contended"]
    (directory / "models.yaml").write_text(yaml.safe_dump(models))
    # A pool that sets its cap alone keeps it when tenants contend (not the setting's 3).
    assert queues.caps_of(load_policies(directory).models["m"], _pair(None)) == (6, 6)
    # The queue follows a reloaded policy (a new model object), not only a new engine report.
    queue = queues.queue(model, _pair(None))
    assert (queue.capacity, queue.contended_capacity) == (12, 3)
    assert queues.queue(reloaded, _pair(None)) is queue
    assert (queue.capacity, queue.contended_capacity) == (6, 6)
    assert queues.caps_of(model, _pair(None)) == (12, 3)
    no_contended = PairQueues(QueueSettings(12, 10.0, 10), Metrics())
    assert no_contended.caps_of(model, _pair(None)) == (12, 12)


def test_refusals_are_429_over_share_and_503_pool_full_with_retry_after() -> None:
    over = queue_refusal(WaitExpired(True, 2.2, "wait_expired"), "shared")
    full = queue_refusal(WaitExpired(False, 1.0, "wait_expired"), "shared")
    assert (over.status, over.type, over.code, over.headers["Retry-After"]) == (
        429,
        "rate_limit_error",
        "tenant_over_share",
        "3",
    )
    assert (full.status, full.code, full.headers["Retry-After"]) == (503, "pool_saturated", "1")
    assert set(over.body()["error"]) == {"message", "type", "param", "code"}


def _policies_with(tmp_path: Path, tenants: dict[str, Any], pool_cap: int | None = None) -> Path:
    directory = write_policies(
        tmp_path,
        model_name="m",
        tokenizer_dir=tmp_path,
        pools=[PoolSpec("shared", (("http://p:1", 2),), ("http://d:1",))],
        tenants=tenants,
    )
    if pool_cap is not None:
        models = yaml.safe_load((directory / "models.yaml").read_text())
        models["models"][0]["pools"][0]["max_in_flight_per_pair"] = pool_cap
        (directory / "models.yaml").write_text(yaml.safe_dump(models))
    return directory


def test_weights_priorities_and_pool_caps_are_read_from_the_policy_files(tmp_path: Path) -> None:
    policies = load_policies(
        _policies_with(tmp_path, {"acme": {"weight": 2.5, "priority": "high"}}, pool_cap=6)
    )
    assert (policies.tenant("acme").weight, policies.tenant("acme").priority) == (2.5, "high")
    assert (policies.tenant("other").weight, policies.tenant("other").priority) == (1.0, "normal")
    assert policies.models["m"].pools[0].max_in_flight_per_pair == 6


@pytest.mark.parametrize(
    ("tenants", "pool_cap", "field"),
    [
        ({"acme": {"weight": 0}}, None, "weight"),
        ({"acme": {"weight": -1}}, None, "weight"),
        ({"acme": {"priority": "urgent"}}, None, "priority"),
        ({}, 0, "max_in_flight_per_pair"),
    ],
)
def test_a_bad_share_in_a_policy_file_is_refused_at_load(
    tmp_path: Path, tenants: dict[str, Any], pool_cap: int | None, field: str
) -> None:
    with pytest.raises(PolicyError, match=field):
        load_policies(_policies_with(tmp_path, tenants, pool_cap))


# -- shares counted in tokens (the virtual token counter) -------------------------------------


async def _tokens_served(
    queue: FairQueue,
    requests: list[tuple[Share, list[tuple[float, float]]]],
    rounds: int,
) -> dict[str, float]:
    """Every tenant floods with its ``(charged, produced)`` requests, in turn, behind a
    saturated queue of one slot; the slot is handed on ``rounds`` times and each grant is
    refunded what it did not produce. What each tenant was served, in produced cost."""
    blocker = await queue.acquire(Share("blocker"), FOREVER)
    served: Counter[str] = Counter()
    slots: asyncio.Queue[tuple[Slot, str, float]] = asyncio.Queue()

    async def one(share: Share, charged: float, produced: float) -> None:
        slot = await queue.acquire(share, FOREVER, cost=charged)
        await slots.put((slot, share.tenant_id, charged - produced))
        served[share.tenant_id] += produced

    tasks = [
        asyncio.ensure_future(one(share, charged, produced))
        for share, flood in requests
        for charged, produced in flood
    ]
    await asyncio.sleep(0)
    blocker.release()
    for _ in range(rounds):
        slot, _, unproduced = await slots.get()
        slot.refund(unproduced)
        slot.release()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return dict(served)


def test_weights_two_to_one_are_served_two_to_one_in_tokens_whatever_the_request_sizes() -> None:
    # Heavy (weight 2) sends small requests, light (weight 1) requests ten times larger: counted
    # in requests light would get ten times its share; counted in tokens, 2 : 1.
    heavy, light = Share("heavy", weight=2), Share("light", weight=1)
    served = asyncio.run(
        _tokens_served(
            FairQueue(1, max_queued_per_tenant=1000),
            [(heavy, [(10.0, 10.0)] * 400), (light, [(100.0, 100.0)] * 40)],
            rounds=200,
        )
    )
    assert served["heavy"] == pytest.approx(2 * served["light"], rel=0.15), served


def test_what_a_request_did_not_produce_is_given_back_to_its_tenant() -> None:
    # Both reserve 100 tokens a request; heavy's stop after 20. Charged what they reserved and
    # never refunded, heavy would be served 2 : 1 in requests, 0.4 : 1 in tokens; refunded,
    # heavy is served 2 : 1 in the tokens produced.
    heavy, light = Share("heavy", weight=2), Share("light", weight=1)
    served = asyncio.run(
        _tokens_served(
            FairQueue(1, max_queued_per_tenant=1000),
            [(heavy, [(100.0, 20.0)] * 400), (light, [(100.0, 100.0)] * 100)],
            rounds=200,
        )
    )
    assert served["heavy"] == pytest.approx(2 * served["light"], rel=0.15), served


def test_a_refund_never_puts_its_tenant_ahead_of_the_others() -> None:
    async def scenario() -> list[str]:
        queue = FairQueue(1, max_queued_per_tenant=100)
        slot = await queue.acquire(Share("a"), FOREVER, cost=5.0)
        slot.refund(1_000_000.0)  # a tenant cannot buy credit with a refund
        slot.release()
        return await _serve_in_order(queue, [Share("a")] * 4 + [Share("b")] * 4)

    assert asyncio.run(scenario()) == ["a", "b"] * 4


def test_a_request_of_many_generations_is_charged_them_all() -> None:
    # One grant of cost 8 (eight generations), then both flood with requests of cost 1: the
    # other tenant is served about eight times before the first one's next turn.
    async def scenario() -> list[str]:
        queue = FairQueue(1, max_queued_per_tenant=100)
        blocker = await queue.acquire(Share("blocker"), FOREVER)
        big = asyncio.ensure_future(queue.acquire(Share("a"), FOREVER, cost=8.0))
        await asyncio.sleep(0)
        blocker.release()
        (await big).release()
        return await _serve_in_order(queue, [Share("a")] * 10 + [Share("b")] * 10, served=10)

    order = asyncio.run(scenario())
    assert order[:8].count("b") >= 7, order


def test_a_grant_waits_for_kv_room_and_takes_it_as_it_frees() -> None:
    async def scenario() -> None:
        queue = FairQueue(8, max_queued_per_tenant=10, kv_capacity=1000)
        first = await queue.acquire(Share("a"), FOREVER, kv=700)
        assert queue.take_free(Share("b"), kv=400) is None  # a slot is free, the tokens not
        waiting = asyncio.ensure_future(queue.acquire(Share("b"), FOREVER, kv=400))
        await asyncio.sleep(0)
        assert not waiting.done() and queue.kv_in_flight == 700
        first.release()
        second = await waiting
        assert queue.kv_in_flight == 400
        second.release()
        assert queue.kv_in_flight == 0

    asyncio.run(scenario())


def test_engine_priorities_put_classes_first_then_work_within_its_share() -> None:
    order = sorted(
        (engine_priority(priority, within), priority, within)
        for priority in ("high", "normal", "low")
        for within in (True, False)
    )
    assert [(p, w) for _, p, w in reversed(order)] == [
        ("high", True),
        ("high", False),
        ("normal", True),
        ("normal", False),
        ("low", True),
        ("low", False),
    ]
    # Within a class, the gap is past SGLang's default preemption threshold (10).
    assert engine_priority("normal", True) - engine_priority("normal", False) > 10
    assert engine_priority("normal", False) == ENGINE_DEFAULT_PRIORITY


def test_a_lower_class_gets_no_share_past_the_contended_cap_while_a_higher_one_is_active() -> None:
    async def scenario() -> None:
        queue = FairQueue(2, contended_capacity=1, max_queued_per_tenant=10)
        vip = [await queue.acquire(Share("vip", priority="high"), FOREVER) for _ in range(2)]
        assert queue.take_free(Share("bulk", priority="low")) is None
        assert queue.take_free(Share("std")) is None
        for slot in vip:
            slot.release()

    asyncio.run(scenario())


def test_generation_cost_weighs_an_output_token_above_a_prompt_token() -> None:
    assert generation_cost(100, 0) == 100
    assert generation_cost(0, 100) > generation_cost(100, 0)
    assert generation_cost(10, 16) == generation_cost(10, 0) + generation_cost(0, 16)


def test_one_requests_share_is_the_pools_max_request_share_of_the_cap_and_the_kv_pool(
    tmp_path: Path,
) -> None:
    directory = _policies_with(tmp_path, {})
    queues = PairQueues(QueueSettings(12, 10.0, 10), Metrics())
    pair = _pair(None)  # KV pools of 1,000 tokens
    assert queues.request_bound(load_policies(directory).models["m"], pair) == RequestBound(6, 500)
    models = yaml.safe_load((directory / "models.yaml").read_text())
    models["models"][0]["pools"][0]["max_request_share"] = 0.1
    (directory / "models.yaml").write_text(yaml.safe_dump(models))
    # At least one generation, whatever the share.
    assert queues.request_bound(load_policies(directory).models["m"], pair) == RequestBound(1, 100)
    # The queue grants what the pool holds, split among replicas as the cap is.
    split = PairQueues(QueueSettings(12, 10.0, 10, replicas=2), Metrics())
    assert split.queue(load_policies(directory).models["m"], pair).kv_capacity == 500
