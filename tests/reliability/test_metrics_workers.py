"""``/metrics`` of ``isogate serve --workers 2`` speaks for the whole gateway: whichever process
answers a scrape, the request counter and the latency histogram count every process's requests.

The processes share one port, and which one accepts a connection is the kernel's choice: the
requests are sent on connections of their own, several at once, so both processes serve some,
and every scrape is a connection of its own, so both answer some.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.stack import STANDIN_POOL_TOKENS
from tests.reliability.test_shared_claims_replicas import _post, deployment

pytestmark = pytest.mark.redis

REQUESTS = 24
SCRAPES = 12


def _request_counts(url: str, admin_key: str) -> tuple[float, float]:
    """The requests counted by one scrape: the counter's total and the histogram's count. Its
    worker pool gauges are the stand-ins' pools, which every process polls: never summed."""
    body = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
    body.raise_for_status()
    counted = histogram = 0.0
    for family in text_string_to_metric_families(body.text):
        for sample in family.samples:
            if sample.name == "isogate_requests_total":
                counted += sample.value
            elif sample.name == "isogate_request_duration_seconds_count":
                histogram += sample.value
            elif sample.name == "isogate_worker_kv_pool_tokens":
                assert sample.value == STANDIN_POOL_TOKENS, sample
    return counted, histogram


def test_every_scrape_of_a_multi_process_gateway_counts_every_processes_requests(
    tmp_path: Path,
) -> None:
    with deployment(tmp_path, "workers", pool=STANDIN_POOL_TOKENS) as stack:
        stack.gate.set()  # the stand-in decode answers at once
        key = stack.key("acme")
        url = stack.urls[0]
        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(lambda _: _post(url, key, 4), range(REQUESTS)))
        assert statuses == [200] * REQUESTS
        # Each process publishes its series on a timer: wait until a scrape has them all.
        deadline = time.monotonic() + 30
        while (counts := _request_counts(url, stack.admin_key)) != (REQUESTS, REQUESTS):
            assert time.monotonic() < deadline, f"no scrape counted every request: {counts}"
            time.sleep(0.2)
        seen = [_request_counts(url, stack.admin_key) for _ in range(SCRAPES)]
        assert seen == [(REQUESTS, REQUESTS)] * SCRAPES
