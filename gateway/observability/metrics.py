"""Prometheus metrics, all under ``isogate_``, on the gateway's own registry (no globals).

The series every request touches (its count and latency, its queue wait, length and served
count) are plain integers and bucket lists, exported by a collector when ``/metrics`` is
scraped: prometheus_client's ``inc``/``observe`` take a lock and walk the buckets in Python on
each call, which cost a request 2.4 % of its instructions (``bench/RESULTS.md``). They are
updated on the event loop only. The rarer series (refusals, worker capacity) stay the
library's own.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gateway.observability.multiprocess import GaugeRule
from gateway.workers.capacity import CapacityRegistry

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_BUCKET_LABELS = [*map(floatToGoString, _LATENCY_BUCKETS), "+Inf"]


class LatencyBuckets:
    """One label set's histogram: a count per bucket (the last one +Inf) and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        # The first bound at or above the value: Prometheus buckets are "less than or equal".
        self.counts[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        running, buckets = 0, []
        for label, count in zip(_BUCKET_LABELS, self.counts, strict=True):
            running += count
            buckets.append((label, float(running)))
        return buckets


class RequestSeries:
    """What one request of a (model, tenant, outcome) adds: its count, and its latency into the
    (model, outcome) histogram it shares with the other tenants."""

    __slots__ = ("count", "latency")

    def __init__(self, latency: LatencyBuckets) -> None:
        self.count = 0
        self.latency = latency


class QueueSeries:
    """One tenant's series on one pool's queues: waiting now, waits, slots served."""

    __slots__ = ("served", "wait", "waiting")

    def __init__(self) -> None:
        self.waiting = 0
        self.wait = LatencyBuckets()
        self.served = 0


class PerRequestSeries:
    """The collector of the per-request series (see the module doc)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], RequestSeries] = {}
        self.latency: dict[tuple[str, str], LatencyBuckets] = {}
        self.queues: dict[tuple[str, str], QueueSeries] = {}

    def request(self, model: str, tenant: str, outcome: str) -> RequestSeries:
        key = (model, tenant, outcome)
        series = self.requests.get(key)
        if series is None:
            latency = self.latency.setdefault((model, outcome), LatencyBuckets())
            series = self.requests[key] = RequestSeries(latency)
        return series

    def queue(self, pool: str, tenant: str) -> QueueSeries:
        return self.queues.setdefault((pool, tenant), QueueSeries())

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "isogate_requests",
            "Generation requests by model, tenant and outcome.",
            labels=["model", "tenant", "outcome"],
        )
        for (model, tenant, outcome), series in list(self.requests.items()):
            requests.add_metric([model, tenant, outcome], series.count)
        latency = HistogramMetricFamily(
            "isogate_request_duration_seconds",
            "Request latency through the gateway.",
            labels=["model", "outcome"],
        )
        for (model, outcome), buckets in list(self.latency.items()):
            latency.add_metric([model, outcome], buckets.cumulative(), buckets.total)
        length = GaugeMetricFamily(
            "isogate_queue_length",
            "Requests waiting for a slot of a worker pair, by pool and tenant.",
            labels=["pool", "tenant"],
        )
        wait = HistogramMetricFamily(
            "isogate_queue_wait_seconds",
            "Time a request waited for its slot (0 when a slot was free), by pool and tenant.",
            labels=["pool", "tenant"],
        )
        served = CounterMetricFamily(
            "isogate_queue_served",
            "Requests that got a slot of a worker pair, by pool and tenant (their shares).",
            labels=["pool", "tenant"],
        )
        for (pool, tenant), queue in list(self.queues.items()):
            length.add_metric([pool, tenant], queue.waiting)
            wait.add_metric([pool, tenant], queue.wait.cumulative(), queue.wait.total)
            served.add_metric([pool, tenant], queue.served)
        yield from (requests, latency, length, wait, served)


class LoopLagSeries:
    """The event loop's lateness (``gateway.observability.loop_lag``): every wake-up of the
    probe into a histogram, and the largest lateness and the largest held time (lateness not
    spent waiting for a CPU) since the last scrape as gauges.

    The gauges are reset when read, so each scrape (or test) sees the worst stall since the one
    before, which a histogram's buckets cannot say. Scrapes run in a worker thread
    (``asyncio.to_thread``) while the probe writes on the loop: the lock keeps a wake-up from
    being lost between the read and the reset.

    With several processes (``gateway.observability.multiprocess``) a process's report is its
    file, which a scrape may or may not read before the next one replaces it:
    ``last_report_read`` says whether one did, and until then the maxima reported are carried
    into the next report, so a stall is reported until a scrape has seen it.
    """

    def __init__(self, last_report_read: Callable[[], bool] | None = None) -> None:
        self._lock = threading.Lock()
        self._lag = LatencyBuckets()
        self._max_lag = 0.0
        self._max_held = 0.0
        self._last_report_read = last_report_read  # None: every report is a scrape's
        self._unread_lag = 0.0
        self._unread_held = 0.0

    def observe(self, lag_s: float, held_s: float) -> None:
        with self._lock:
            self._lag.observe(lag_s)
            if lag_s > self._max_lag:
                self._max_lag = lag_s
            if held_s > self._max_held:
                self._max_held = held_s

    def describe(self) -> Iterator[Metric]:
        # Without it the registry collects once to learn the names, and that read resets.
        yield HistogramMetricFamily("isogate_event_loop_lag_seconds", "")
        yield GaugeMetricFamily("isogate_event_loop_lag_max_seconds", "")
        yield GaugeMetricFamily("isogate_event_loop_held_max_seconds", "")

    def collect(self) -> Iterator[Metric]:
        read = self._last_report_read is None or self._last_report_read()  # (a file: unlocked)
        with self._lock:
            buckets, total = self._lag.cumulative(), self._lag.total
            if read:
                self._unread_lag = self._unread_held = 0.0
            largest = self._unread_lag = max(self._unread_lag, self._max_lag)
            held = self._unread_held = max(self._unread_held, self._max_held)
            self._max_lag = self._max_held = 0.0
        lag = HistogramMetricFamily(
            "isogate_event_loop_lag_seconds",
            "How late the event loop ran a timer: the time it was held, or waited for a CPU.",
        )
        lag.add_metric([], buckets, total)
        yield lag
        yield GaugeMetricFamily(
            "isogate_event_loop_lag_max_seconds",
            "The largest event loop lag since the last scrape (reset when read).",
            value=largest,
        )
        yield GaugeMetricFamily(
            "isogate_event_loop_held_max_seconds",
            "The largest event loop lag since the last scrape that the gateway's own work "
            "caused, not a wait for a CPU held by other processes (reset when read).",
            value=held,
        )


# How a scrape of several processes combines each gauge (``GaugeRule``); any other gauge is
# one value that every process reads from a shared source (a worker's capacity): the freshest.
GAUGE_RULES: Mapping[str, GaugeRule] = {
    "isogate_queue_length": "livesum",
    "isogate_event_loop_lag_max_seconds": "livemax",
    "isogate_event_loop_held_max_seconds": "livemax",
}


class Metrics:
    """The gateway's series. ``last_report_read``: with several processes, whether a scrape
    has read this process's last report (``LoopLagSeries``)."""

    def __init__(self, last_report_read: Callable[[], bool] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.admission_refusals = Counter(
            "isogate_admission_refusals",
            "Prompts refused by gate 1, by the bound that set the limit.",
            ["model", "bound"],
            registry=self.registry,
        )
        self.refused_untokenized = Counter(
            "isogate_admission_refused_untokenized",
            "Prompts refused on byte length alone, without tokenizing.",
            ["model"],
            registry=self.registry,
        )
        self.verification_failures = Counter(
            "isogate_verification_failures",
            "Responses withheld by an isolation check.",
            ["model", "reason"],
            registry=self.registry,
        )
        self.canary_hits = Counter(
            "isogate_canary_hits",
            (
                "Outputs that carried another tenant's canary marker, "
                "by the tenant they were withheld from."
            ),
            ["tenant"],
            registry=self.registry,
        )
        self.budget_soft_crossings = Counter(
            "isogate_budget_soft_crossings",
            "Token budgets that passed their soft threshold, by tenant and scope ('tenant' or "
            "'model M').",
            ["tenant", "scope"],
            registry=self.registry,
        )
        self.budget_refusals = Counter(
            "isogate_budget_refusals",
            "Requests refused because a token budget was spent, by tenant and scope.",
            ["tenant", "scope"],
            registry=self.registry,
        )
        self.unauthenticated_requests = Counter(
            "isogate_unauthenticated_requests",
            "Generation requests refused before a tenant was known, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.pool_tokens = Gauge(
            "isogate_worker_kv_pool_tokens",
            "Live KV pool capacity per worker.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.used_tokens = Gauge(
            "isogate_worker_kv_used_tokens",
            "KV tokens in use per worker.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.worker_fresh = Gauge(
            "isogate_worker_capacity_fresh",
            "1 when the worker's capacity data is fresh.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.worker_alive = Gauge(
            "isogate_worker_alive",
            "1 when the worker passed its liveness probe recently (SGLang's /health).",
            ["worker", "role"],
            registry=self.registry,
        )
        self.worker_routed = Gauge(
            "isogate_worker_routed",
            "1 when the worker is routed to: fresh capacity, or an older record while alive.",
            ["worker", "role"],
            registry=self.registry,
        )
        self.queue_refused = Counter(
            "isogate_queue_refused",
            "Requests refused by the fair queue, by pool, tenant and reason.",
            ["pool", "tenant", "reason"],
            registry=self.registry,
        )
        self.auth_invalidations = Counter(
            "isogate_auth_invalidations_received",
            "Key revocations and tenant changes of other replicas applied to this one's key "
            "cache (through Redis), by kind (key, tenant).",
            ["kind"],
            registry=self.registry,
        )
        self.stored_responses = Gauge(
            "isogate_stored_responses",
            "Stored responses (Responses API) not yet expired, per tenant, as of the last sweep.",
            ["tenant"],
            registry=self.registry,
        )
        self.per_request = PerRequestSeries()
        self.registry.register(self.per_request)
        self.loop_lag = LoopLagSeries(last_report_read)
        self.registry.register(self.loop_lag)

    def stored_response_counts(self, counts: dict[str, int]) -> None:
        """Each tenant's stored responses; a tenant with none left drops out of the series."""
        self.stored_responses.clear()
        for tenant, count in counts.items():
            self.stored_responses.labels(tenant).set(count)

    def unauthenticated(self, code: str) -> None:
        self.unauthenticated_requests.labels(code).inc()

    def refused_untokenized_inc(self, model: str) -> None:
        self.refused_untokenized.labels(model).inc()

    def verification_failed(self, model: str, reason: str) -> None:
        # Reasons are short fixed phrases; numbers are cut so the label set stays bounded.
        self.verification_failures.labels(model, reason.split(":")[0][:60]).inc()

    def observe_request(self, model: str, tenant: str, outcome: str, seconds: float) -> None:
        series = self.per_request.request(model, tenant, outcome)
        series.count += 1
        series.latency.observe(seconds)

    def queue_observer(self, pool: str) -> PoolQueueMetrics:
        return PoolQueueMetrics(self, pool)

    def export(self, capacity: CapacityRegistry, workers: Sequence[tuple[str, str]]) -> bytes:
        self._worker_gauges(capacity, workers)
        return generate_latest(self.registry)

    def families(
        self, capacity: CapacityRegistry, workers: Sequence[tuple[str, str]]
    ) -> list[Metric]:
        """What ``export`` renders, as families (a process's part of several's ``/metrics``)."""
        self._worker_gauges(capacity, workers)
        return list(self.registry.collect())

    def _worker_gauges(
        self, capacity: CapacityRegistry, workers: Sequence[tuple[str, str]]
    ) -> None:
        for url, role in workers:
            state = capacity.get(url)
            self.worker_fresh.labels(url, role).set(1 if capacity.fresh(url) else 0)
            self.worker_alive.labels(url, role).set(1 if capacity.alive(url) else 0)
            self.worker_routed.labels(url, role).set(1 if state else 0)
            if state:
                self.pool_tokens.labels(url, role).set(state.max_total_num_tokens)
                self.used_tokens.labels(url, role).set(state.used_tokens)


class PoolQueueMetrics:
    """The fair queue's reports (``gateway.core.fair_queue.QueueObserver``) for one pool."""

    def __init__(self, metrics: Metrics, pool: str) -> None:
        self._metrics = metrics
        self._pool = pool
        self._series: dict[str, QueueSeries] = {}

    def _of(self, tenant_id: str) -> QueueSeries:
        series = self._series.get(tenant_id)
        if series is None:
            series = self._series[tenant_id] = self._metrics.per_request.queue(
                self._pool, tenant_id
            )
        return series

    def queued(self, tenant_id: str, change: int) -> None:
        self._of(tenant_id).waiting += change

    def started(self, tenant_id: str, waited_s: float) -> None:
        series = self._series.get(tenant_id) or self._of(tenant_id)  # every request comes here
        series.served += 1
        series.wait.observe(waited_s)

    def refused(self, tenant_id: str, reason: str) -> None:
        self._metrics.queue_refused.labels(self._pool, tenant_id, reason).inc()
