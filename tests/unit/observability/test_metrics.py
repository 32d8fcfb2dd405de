"""The per-request series, counted in plain integers, expose what prometheus_client's own
``Counter``, ``Histogram`` and ``Gauge`` would for the same observations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import _LATENCY_BUCKETS, Metrics

# On and between bucket bounds, below the first and above the last.
_SECONDS = [0.0, 0.001, 0.0011, 0.0025, 0.07, 1.0, 2.5, 59.9, 120.0, 500.0]


def _samples(text: str, prefix: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefix)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_request_count_and_latency_expose_as_the_library_would() -> None:
    metrics = Metrics()
    library = CollectorRegistry()
    count = Counter("isogate_requests", "x", ["model", "tenant", "outcome"], registry=library)
    latency = Histogram(
        "isogate_request_duration_seconds",
        "x",
        ["model", "outcome"],
        buckets=_LATENCY_BUCKETS,
        registry=library,
    )
    for index, seconds in enumerate(_SECONDS):
        tenant = f"t{index % 3}"  # tenants share their (model, outcome) histogram
        outcome = "served" if index % 4 else "rejected"
        metrics.observe_request("m", tenant, outcome, seconds)
        count.labels("m", tenant, outcome).inc()
        latency.labels("m", outcome).observe(seconds)

    ours = _samples(generate_latest(metrics.registry).decode(), "isogate_request")
    expected = _samples(generate_latest(library).decode(), "isogate_request")
    assert ours == expected
    assert (
        ours[
            (
                "isogate_requests_total",
                frozenset({("model", "m"), ("tenant", "t0"), ("outcome", "served")}),
            )
        ]
        == 3  # requests 3, 6 and 9
    )


def test_queue_series_expose_as_the_library_would() -> None:
    metrics = Metrics()
    observer = metrics.queue_observer("pool-a")
    library = CollectorRegistry()
    length = Gauge("isogate_queue_length", "x", ["pool", "tenant"], registry=library)
    wait = Histogram(
        "isogate_queue_wait_seconds",
        "x",
        ["pool", "tenant"],
        buckets=_LATENCY_BUCKETS,
        registry=library,
    )
    served = Counter("isogate_queue_served", "x", ["pool", "tenant"], registry=library)
    for index, seconds in enumerate(_SECONDS):
        tenant = f"t{index % 2}"
        observer.queued(tenant, 1)
        length.labels("pool-a", tenant).inc(1)
        if index % 3:
            observer.queued(tenant, -1)
            length.labels("pool-a", tenant).inc(-1)
            observer.started(tenant, seconds)
            wait.labels("pool-a", tenant).observe(seconds)
            served.labels("pool-a", tenant).inc()

    ours = _samples(generate_latest(metrics.registry).decode(), "isogate_queue")
    expected = _samples(generate_latest(library).decode(), "isogate_queue")
    assert ours == expected
    assert ours[("isogate_queue_length", frozenset({("pool", "pool-a"), ("tenant", "t0")}))] == 2
