"""Prometheus metrics, all under ``isogate_``, on the gateway's own registry (no globals)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .capacity import CapacityRegistry

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "isogate_requests",
            "Generation requests by model, tenant and outcome.",
            ["model", "tenant", "outcome"],
            registry=self.registry,
        )
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
        self.unauthenticated_requests = Counter(
            "isogate_unauthenticated_requests",
            "Generation requests refused before a tenant was known, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "isogate_request_duration_seconds",
            "Request latency through the gateway.",
            ["model", "outcome"],
            buckets=_LATENCY_BUCKETS,
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
        self.queue_length = Gauge(
            "isogate_queue_length",
            "Requests waiting for a slot of a worker pair, by pool and tenant.",
            ["pool", "tenant"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "isogate_queue_wait_seconds",
            "Time a request waited for its slot (0 when a slot was free), by pool and tenant.",
            ["pool", "tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_served = Counter(
            "isogate_queue_served",
            "Requests that got a slot of a worker pair, by pool and tenant (their shares).",
            ["pool", "tenant"],
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
        # The children of every request's two series, by labels: ``labels()`` validates and
        # locks on each call. As bounded as the series themselves (models x tenants x outcomes).
        self._request_series: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def unauthenticated(self, code: str) -> None:
        self.unauthenticated_requests.labels(code).inc()

    def refused_untokenized_inc(self, model: str) -> None:
        self.refused_untokenized.labels(model).inc()

    def verification_failed(self, model: str, reason: str) -> None:
        # Reasons are short fixed phrases; numbers are cut so the label set stays bounded.
        self.verification_failures.labels(model, reason.split(":")[0][:60]).inc()

    def observe_request(self, model: str, tenant: str, outcome: str, seconds: float) -> None:
        key = (model, tenant, outcome)
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (
                self.requests.labels(model, tenant, outcome),
                self.latency.labels(model, outcome),
            )
        count, latency = series
        count.inc()
        latency.observe(seconds)

    def queue_observer(self, pool: str) -> PoolQueueMetrics:
        return PoolQueueMetrics(self, pool)

    def export(self, capacity: CapacityRegistry, workers: list[tuple[str, str]]) -> bytes:
        for url, role in workers:
            state = capacity.get(url)
            self.worker_fresh.labels(url, role).set(1 if capacity.fresh(url) else 0)
            self.worker_alive.labels(url, role).set(1 if capacity.alive(url) else 0)
            self.worker_routed.labels(url, role).set(1 if state else 0)
            if state:
                self.pool_tokens.labels(url, role).set(state.max_total_num_tokens)
                self.used_tokens.labels(url, role).set(state.used_tokens)
        return generate_latest(self.registry)


class PoolQueueMetrics:
    """The fair queue's reports (``gateway.fair_queue.QueueObserver``) for one pool."""

    def __init__(self, metrics: Metrics, pool: str) -> None:
        self._metrics = metrics
        self._pool = pool
        # Each tenant's three per-request children (``labels()`` validates and locks per call).
        self._series: dict[str, tuple[Any, Any, Any]] = {}

    def _of(self, tenant_id: str) -> tuple[Any, Any, Any]:
        series = self._series.get(tenant_id)
        if series is None:
            m, pool = self._metrics, self._pool
            series = self._series[tenant_id] = (
                m.queue_length.labels(pool, tenant_id),
                m.queue_wait.labels(pool, tenant_id),
                m.queue_served.labels(pool, tenant_id),
            )
        return series

    def queued(self, tenant_id: str, change: int) -> None:
        self._of(tenant_id)[0].inc(change)

    def waited(self, tenant_id: str, seconds: float) -> None:
        self._of(tenant_id)[1].observe(seconds)

    def served(self, tenant_id: str) -> None:
        self._of(tenant_id)[2].inc()

    def refused(self, tenant_id: str, reason: str) -> None:
        self._metrics.queue_refused.labels(self._pool, tenant_id, reason).inc()
