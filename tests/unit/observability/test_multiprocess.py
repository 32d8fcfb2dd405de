"""Several processes' metrics as one: counters and histograms summed over every process (exited
ones too), gauges combined by their rule over live ones, and a stall reported until a scrape of
any process has seen it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import GAUGE_RULES, Metrics
from gateway.observability.multiprocess import (
    ProcessFamilies,
    ProcessMetrics,
    decode,
    encode,
    merge,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: bytes | str) -> Samples:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _process(metrics: Metrics, *, live: bool = True, written_at: float = 1.0) -> ProcessFamilies:
    # Through its file's form, as a scrape reads the other processes.
    return ProcessFamilies(decode(encode(metrics.registry.collect())), live, written_at)


def _busy_process(requests: int, seconds: float) -> Metrics:
    metrics = Metrics()
    for _ in range(requests):
        metrics.observe_request("m", "acme", "completed", seconds)
    return metrics


def test_one_process_merged_alone_reads_as_its_own_exposition() -> None:
    metrics = _busy_process(3, 0.02)
    metrics.admission_refusals.labels("m", "decode KV pool").inc()
    metrics.queue_observer("pool").queued("acme", 2)
    metrics.pool_tokens.labels("http://w", "decode").set(4096)
    metrics.used_tokens.labels("http://w", "decode").set(float("nan"))
    merged = merge([_process(metrics)], GAUGE_RULES)
    assert merged == generate_latest(metrics.registry)


def test_counters_and_histograms_sum_over_processes() -> None:
    merged = _samples(
        merge([_process(_busy_process(3, 0.02)), _process(_busy_process(4, 2.0))], GAUGE_RULES)
    )
    labels = {"model": "m", "tenant": "acme", "outcome": "completed"}
    assert _value(merged, "isogate_requests_total", **labels) == 7
    latency = {"model": "m", "outcome": "completed"}
    assert _value(merged, "isogate_request_duration_seconds_count", **latency) == 7
    assert _value(merged, "isogate_request_duration_seconds_sum", **latency) == 3 * 0.02 + 4 * 2.0
    # Each bucket is the sum of the processes' (cumulative): 3 under 0.025 s, all 7 under 2.5 s.
    assert _value(merged, "isogate_request_duration_seconds_bucket", le="0.025", **latency) == 3
    assert _value(merged, "isogate_request_duration_seconds_bucket", le="1.0", **latency) == 3
    assert _value(merged, "isogate_request_duration_seconds_bucket", le="2.5", **latency) == 7
    assert _value(merged, "isogate_request_duration_seconds_bucket", le="+Inf", **latency) == 7


def test_a_series_of_one_process_only_is_kept_as_it_is() -> None:
    first, second = Metrics(), Metrics()
    first.admission_refusals.labels("m", "decode KV pool").inc(2)
    second.admission_refusals.labels("m", "prefill KV pool").inc()
    merged = _samples(merge([_process(first), _process(second)], GAUGE_RULES))
    refusals = "isogate_admission_refusals_total"
    assert _value(merged, refusals, model="m", bound="decode KV pool") == 2
    assert _value(merged, refusals, model="m", bound="prefill KV pool") == 1


def test_gauges_follow_their_rule_over_live_processes() -> None:
    older, newer = Metrics(), Metrics()
    for metrics, waiting, lag, used in ((older, 2, 0.5, 100), (newer, 3, 0.1, 300)):
        metrics.queue_observer("pool").queued("acme", waiting)
        metrics.loop_lag.observe(lag, lag)
        metrics.used_tokens.labels("http://w", "decode").set(used)
    merged = _samples(
        merge([_process(older, written_at=1.0), _process(newer, written_at=2.0)], GAUGE_RULES)
    )
    # What each process holds adds up; the worst stall of any; one worker's use, not twice it.
    assert _value(merged, "isogate_queue_length", pool="pool", tenant="acme") == 5
    assert _value(merged, "isogate_event_loop_lag_max_seconds") == 0.5
    assert _value(merged, "isogate_worker_kv_used_tokens", worker="http://w", role="decode") == 300


def test_an_exited_process_keeps_its_counts_and_loses_its_gauges() -> None:
    live, exited = _busy_process(2, 0.02), _busy_process(5, 0.02)
    live.queue_observer("pool").queued("acme", 1)
    exited.queue_observer("pool").queued("acme", 4)
    exited.used_tokens.labels("http://w", "decode").set(999)
    merged = _samples(
        merge([_process(live), _process(exited, live=False, written_at=9.0)], GAUGE_RULES)
    )
    labels = {"model": "m", "tenant": "acme", "outcome": "completed"}
    assert _value(merged, "isogate_requests_total", **labels) == 7
    assert (
        _value(merged, "isogate_request_duration_seconds_count", model="m", outcome="completed")
        == 7
    )
    assert _value(merged, "isogate_queue_length", pool="pool", tenant="acme") == 1
    assert _value(merged, "isogate_worker_kv_used_tokens", worker="http://w", role="decode") is None


def test_a_counters_created_time_is_the_earliest_processes() -> None:
    processes = []
    for count, created in ((1, 200.0), (2, 100.0)):
        family = CounterMetricFamily("x", "", labels=["a"], created=created)
        family.add_metric(["b"], count, created=created)
        processes.append(ProcessFamilies([family], True, 1.0))
    merged = _samples(merge(processes, GAUGE_RULES))
    assert _value(merged, "x_total", a="b") == 3
    assert _value(merged, "x_created", a="b") == 100


def _render(metrics: Metrics) -> Callable[[], Iterable[Metric]]:
    return metrics.registry.collect


def test_a_scrape_answered_by_either_process_counts_both_and_an_exited_ones(
    tmp_path: Path,
) -> None:
    answering = ProcessMetrics(tmp_path, GAUGE_RULES)
    other = ProcessMetrics(tmp_path, GAUGE_RULES)
    first, second = _busy_process(2, 0.02), _busy_process(3, 0.02)
    second.queue_observer("pool").queued("acme", 1)
    other.write(_render(second))
    labels = {"model": "m", "tenant": "acme", "outcome": "completed"}
    scraped = _samples(answering.scrape(_render(first)))
    assert _value(scraped, "isogate_requests_total", **labels) == 5
    assert _value(scraped, "isogate_queue_length", pool="pool", tenant="acme") == 1
    # The other process answers too, and its own series are the fresh ones.
    second.observe_request("m", "acme", "completed", 0.02)
    scraped = _samples(other.scrape(_render(second)))
    assert _value(scraped, "isogate_requests_total", **labels) == 6
    other.close(_render(second))
    scraped = _samples(answering.scrape(_render(first)))
    assert _value(scraped, "isogate_requests_total", **labels) == 6
    assert _value(scraped, "isogate_queue_length", pool="pool", tenant="acme") is None


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_process_killed_without_a_last_file_keeps_its_counts_not_its_gauges(
    tmp_path: Path, reaped: bool
) -> None:
    # A process that is gone; a zombie (exited, not yet reaped by its parent) is gone too.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, gone.pid, os.WEXITED | (0 if reaped else os.WNOWAIT))
    try:
        killed = ProcessMetrics(tmp_path, GAUGE_RULES, pid=gone.pid)
        metrics = _busy_process(4, 0.02)
        metrics.queue_observer("pool").queued("acme", 3)
        killed.write(_render(metrics))
        scraped = _samples(ProcessMetrics(tmp_path, GAUGE_RULES).scrape(_render(Metrics())))
    finally:
        if not reaped:
            gone.wait()
    labels = {"model": "m", "tenant": "acme", "outcome": "completed"}
    assert _value(scraped, "isogate_requests_total", **labels) == 4
    assert _value(scraped, "isogate_queue_length", pool="pool", tenant="acme") is None


def test_a_stall_is_reported_until_a_scrape_of_any_process_has_seen_it(tmp_path: Path) -> None:
    answering = ProcessMetrics(tmp_path, GAUGE_RULES)
    stalled = ProcessMetrics(tmp_path, GAUGE_RULES)
    answering_metrics = Metrics(answering.last_file_read)
    stalled_metrics = Metrics(stalled.last_file_read)
    stalled_metrics.loop_lag.observe(0.7, 0.6)
    # Written twice before any scrape: the second file still carries the stall.
    stalled.write(_render(stalled_metrics))
    stalled.write(_render(stalled_metrics))
    scraped = _samples(answering.scrape(_render(answering_metrics)))
    assert _value(scraped, "isogate_event_loop_lag_max_seconds") == 0.7
    assert _value(scraped, "isogate_event_loop_held_max_seconds") == 0.6
    # Seen: its next file reports only what came after.
    stalled.write(_render(stalled_metrics))
    scraped = _samples(answering.scrape(_render(answering_metrics)))
    assert _value(scraped, "isogate_event_loop_lag_max_seconds") == 0.0
    assert _value(scraped, "isogate_event_loop_lag_seconds_count") == 1


def test_an_idle_gateways_sums_read_the_same_whichever_process_answers() -> None:
    # Float addition depends on its order, and the order is the answering process's first: a
    # sum that moved by its last digit between scrapes would read as a counter reset.
    processes = [_busy_process(1, seconds) for seconds in (0.1, 0.2, 0.3)]
    latency = {"model": "m", "outcome": "completed"}
    sums = set()
    for newest in range(3):
        merged = merge(
            [
                _process(p, written_at=2.0 if i == newest else 1.0 + i / 10)
                for i, p in enumerate(processes)
            ],
            GAUGE_RULES,
        )
        sums.add(_value(_samples(merged), "isogate_request_duration_seconds_sum", **latency))
    assert len(sums) == 1, sums
