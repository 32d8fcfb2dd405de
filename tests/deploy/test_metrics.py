"""``/metrics`` after real requests: requests by model, tenant and outcome, latency, gate-1
refusals by the bound that set the limit, live pool capacity per worker; Prometheus names."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import MODEL, chat


def _samples(gateway) -> dict[tuple[str, frozenset], float]:
    response = httpx.get(
        gateway.url + "/metrics",
        timeout=10,
        headers={"Authorization": f"Bearer {gateway.admin_key}"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def test_metrics_count_requests_refusals_by_bound_and_pool_capacity(
    start_gateway, standin_pair
) -> None:
    gateway = start_gateway()
    tenant, key = gateway.create_tenant()

    assert chat(gateway, key).status_code == 200
    assert chat(gateway, key).status_code == 200
    # Under the policy's 65536 but over the prefill stand-in's 2048-token pool: gate 1 refuses.
    refused = chat(gateway, key, content="the quick brown fox " * 800)
    assert (
        refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    )
    assert chat(gateway, key, model="no-such-model").status_code == 404

    samples = _samples(gateway)
    served = {("model", MODEL), ("tenant", tenant), ("outcome", "served")}
    assert samples[("isogate_requests_total", frozenset(served))] == 2
    rejected = {("model", MODEL), ("tenant", tenant), ("outcome", "rejected")}
    assert samples[("isogate_requests_total", frozenset(rejected))] == 1
    # A model name the client made up never becomes a label value.
    assert not any(
        name.startswith("isogate_") and ("model", "no-such-model") in labels
        for name, labels in samples
    )
    assert (
        samples[
            (
                "isogate_admission_refusals_total",
                frozenset({("model", MODEL), ("bound", "prefill KV pool")}),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "isogate_request_duration_seconds_count",
                frozenset({("model", MODEL), ("outcome", "served")}),
            )
        ]
        == 2
    )
    assert (
        samples[
            (
                "isogate_request_duration_seconds_sum",
                frozenset({("model", MODEL), ("outcome", "served")}),
            )
        ]
        > 0
    )
    prefill = frozenset({("worker", standin_pair.prefill.url), ("role", "prefill")})
    decode = frozenset({("worker", standin_pair.decode.url), ("role", "decode")})
    assert samples[("isogate_worker_kv_pool_tokens", prefill)] == 2048
    assert samples[("isogate_worker_kv_pool_tokens", decode)] == 4096
    assert samples[("isogate_worker_capacity_fresh", prefill)] == 1


def test_metric_names_follow_prometheus_conventions(start_gateway) -> None:
    gateway = start_gateway()
    _, key = gateway.create_tenant()
    chat(gateway, key)
    text = httpx.get(
        gateway.url + "/metrics",
        timeout=10,
        headers={"Authorization": f"Bearer {gateway.admin_key}"},
    ).text
    families = list(text_string_to_metric_families(text))
    assert {f.name for f in families} >= {
        "isogate_requests",
        "isogate_admission_refusals",
        "isogate_verification_failures",
        "isogate_canary_hits",
        "isogate_request_duration_seconds",
        "isogate_worker_kv_pool_tokens",
        "isogate_worker_kv_used_tokens",
        "isogate_worker_capacity_fresh",
    }
    for family in families:
        assert family.name.startswith("isogate_"), family.name
        assert family.documentation, f"{family.name} has no HELP text"
        if family.type == "counter":
            # Exposed with the _total suffix (the _created series is the client library's own).
            assert {s.name for s in family.samples} <= {
                family.name + "_total",
                family.name + "_created",
            }
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), "latency in base units"
