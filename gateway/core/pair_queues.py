"""One fair queue (``gateway.core.fair_queue``) per worker pair, capped where the pair saturates.

The cap on requests in flight per pair is, in order: the pool's ``max_in_flight_per_pair``
(``policies/models.yaml``) when set; else the smaller of the setting
``queue_in_flight_per_pair`` (where a measured pair's throughput stopped growing with
concurrency, docs/operations.md) and the engine's own ``max_running_requests`` of either
worker (past it the engine queues them itself, first come first served). The cap while
several tenants contend for the pair is found the same way, from the pool's
``max_in_flight_per_pair_contended`` or the setting ``queue_in_flight_per_pair_contended``
(where a measured pair's latency was still close to a lone request's), never above the first;
a pool that sets its own cap and not this one keeps its cap throughout.
With several gateway replicas each one holds ``ceil(cap / replicas)`` of each: their sum stays
within the cap, and each replica shares its part fairly among the tenants it sees
(docs/operations.md).

The KV pool is the queue's second resource: a grant holds the tokens its generations may
occupy (prompt + ``max_tokens`` + the margin, each), and waits while the pool (the smaller of
the two workers', ``ceil``-divided among replicas as the cap is, unless the claims are shared
through Redis) has not room for them, rather than being refused. They are claimed on the
ledger too as the grant leaves the queue (``gateway.core.admission``): the ledger also counts
what the workers report in use (and, shared, every process's claims), and a pair whose live
pool is full of others' work refuses there.

One request's share (``RequestBound``): at most the pool's ``max_request_share`` of the
pair's cap (slots) and of its KV pool (tokens), so that no one request takes the whole pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.common.errors import APIError, unavailable
from gateway.config.policies import ModelPolicy, Share
from gateway.core.fair_queue import FairQueue, Slot, WaitExpired
from gateway.observability.metrics import Metrics
from gateway.workers.pairs import WorkerPair


@dataclass(frozen=True, slots=True)
class QueueSettings:
    default_in_flight: int
    max_wait_s: float
    max_queued_per_tenant: int
    replicas: int = 1
    # None: the same as ``default_in_flight``.
    default_in_flight_contended: int | None = None
    contention_linger_s: float = 1.0
    # KV claims shared by every process (Redis, ``gateway.core.shared_claims``): they bound
    # the pool across replicas, so each replica's queue may grant the whole pool, not a part.
    kv_shared: bool = False


def pair_cap(
    override: int | None,
    default: int,
    engine_limits: tuple[int | None, ...],
    replicas: int = 1,
) -> int:
    """The requests this replica lets be in flight on a pair at once (see the module doc)."""
    if override is not None:
        cap = override
    else:
        cap = min([default, *(limit for limit in engine_limits if limit)])
    return max(1, math.ceil(cap / max(1, replicas)))


@dataclass(frozen=True, slots=True)
class RequestBound:
    """The most of one pair a single request may hold at once."""

    slots: int
    kv: int


def kv_share(pool_tokens: int, replicas: int = 1) -> int:
    """The KV tokens this replica lets be claimed on a pair whose smaller pool is
    ``pool_tokens``."""
    return max(1, math.ceil(pool_tokens / max(1, replicas)))


class _PairQueue:
    """A pair's queue and what its caps were derived from, to derive them again only when
    that changes (the policy reloaded, or the engine reported another limit or pool size)."""

    __slots__ = ("decode_limit", "kv_pool", "model", "prefill_limit", "queue")

    def __init__(
        self,
        model: ModelPolicy,
        limits: tuple[int | None, int | None],
        kv_pool: int,
        queue: FairQueue,
    ) -> None:
        self.model = model
        self.prefill_limit, self.decode_limit = limits
        self.kv_pool = kv_pool
        self.queue = queue


class PairQueues:
    """The queue of every worker pair this replica has sent to, by the pair's two URLs."""

    def __init__(self, settings: QueueSettings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._queues: dict[tuple[str, str], _PairQueue] = {}

    def queue(self, model: ModelPolicy, pair: WorkerPair) -> FairQueue:
        """The pair's queue, its caps brought up to date with the pool's policy and what the
        engine reports now."""
        prefill, decode = pair.prefill_state, pair.decode_state
        prefill_limit = prefill.max_running_requests
        decode_limit = decode.max_running_requests
        kv_pool = min(prefill.max_total_num_tokens, decode.max_total_num_tokens)
        entry = self._queues.get(pair.urls)
        if (
            entry is not None
            and entry.model is model
            and entry.prefill_limit == prefill_limit
            and entry.decode_limit == decode_limit
            and entry.kv_pool == kv_pool
        ):
            return entry.queue
        cap, contended = self.caps_of(model, pair)
        kv = kv_share(kv_pool, 1 if self._settings.kv_shared else self._settings.replicas)
        if entry is None:
            queue = FairQueue(
                cap,
                contended_capacity=contended,
                linger_s=self._settings.contention_linger_s,
                max_queued_per_tenant=self._settings.max_queued_per_tenant,
                kv_capacity=kv,
                observer=self._metrics.queue_observer(pair.pool),
            )
        else:
            queue = entry.queue
            if queue.capacity != cap or queue.contended_capacity != contended:
                queue.set_capacity(cap, contended)
            if queue.kv_capacity != kv:
                queue.set_kv_capacity(kv)
        self._queues[pair.urls] = _PairQueue(model, (prefill_limit, decode_limit), kv_pool, queue)
        return queue

    def request_bound(self, model: ModelPolicy, pair: WorkerPair) -> RequestBound:
        """The most of ``pair`` one request may hold at once (see the module doc)."""
        queue = self.queue(model, pair)
        pool = next((p for p in model.pools if p.name == pair.pool), None)
        share = pool.max_request_share if pool is not None else 1.0
        kv = queue.kv_capacity
        return RequestBound(
            max(1, math.floor(queue.capacity * share)),
            int(kv * share) if math.isfinite(kv) else 2**62,
        )

    def caps_of(self, model: ModelPolicy, pair: WorkerPair) -> tuple[int, int]:
        """The pair's cap, and its cap while several tenants contend (never above the first)."""
        pool = next((p for p in model.pools if p.name == pair.pool), None)
        engine = (pair.prefill_state.max_running_requests, pair.decode_state.max_running_requests)
        settings = self._settings
        cap = pair_cap(
            pool.max_in_flight_per_pair if pool is not None else None,
            settings.default_in_flight,
            engine,
            settings.replicas,
        )
        if pool is not None and pool.max_in_flight_per_pair_contended is not None:
            contended = pair_cap(
                pool.max_in_flight_per_pair_contended, 0, engine, settings.replicas
            )
        elif pool is not None and pool.max_in_flight_per_pair is not None:
            contended = cap  # a pool that sets its cap and not this one: its cap throughout
        else:
            contended = pair_cap(
                None,
                settings.default_in_flight_contended or settings.default_in_flight,
                engine,
                settings.replicas,
            )
        return cap, min(cap, contended)

    def take_free(
        self, model: ModelPolicy, pair: WorkerPair, share: Share, slots: int, kv: int, cost: float
    ) -> Slot | None:
        """A grant of ``slots`` and ``kv`` tokens of ``pair``, charged ``cost``, at once if there
        is room and it need not queue; else None, and ``wait_turn``. Not a coroutine: most
        requests find room."""
        return self.queue(model, pair).take_free(share, slots, kv=kv, cost=cost)

    async def wait_turn(
        self, model: ModelPolicy, pair: WorkerPair, share: Share, slots: int, kv: int, cost: float
    ) -> Slot:
        """The grant once its turn comes, waiting at most ``max_wait_s``; then a refusal in
        OpenAI's terms: 429 for a tenant over its share, 503 for a full pair. A grant larger
        than this replica's part of the KV pool never comes: a 400 at once."""
        queue = self.queue(model, pair)
        if kv > queue.kv_capacity:
            raise APIError(
                400,
                f"This request needs {kv} KV tokens of pool '{pair.pool}' at once; each of the "
                f"{self._settings.replicas} gateway processes sharing its workers without Redis "
                f"may hold at most {int(queue.kv_capacity)} (ISOGATE_REDIS_URL shares the whole "
                "pool among them). Send a shorter prompt or a smaller max_tokens.",
                "invalid_request_error",
                "request_too_large",
            )
        try:
            return await queue.wait_turn(share, self._settings.max_wait_s, slots, kv=kv, cost=cost)
        except WaitExpired as expired:
            raise queue_refusal(expired, pair.pool) from None


def queue_refusal(expired: WaitExpired, pool: str) -> APIError:
    if expired.over_share:
        return APIError(
            429,
            "This tenant is using its share of the workers of pool "
            f"'{pool}' and its request waited too long for a turn ({expired.reason}); "
            "retry after the time given in Retry-After.",
            "rate_limit_error",
            "tenant_over_share",
            headers={"Retry-After": str(max(1, math.ceil(expired.retry_after_s)))},
        )
    return unavailable(
        f"Every worker of pool '{pool}' is busy and the request waited too long for a turn "
        f"({expired.reason}); try again after the time given in Retry-After.",
        retry_after_s=expired.retry_after_s,
        code="pool_saturated",
    )
