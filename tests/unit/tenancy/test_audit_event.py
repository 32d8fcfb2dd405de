"""What a request's trace says in its audit event: every column from its own source.

A value taken from the wrong source would go to a column of the same type unnoticed by the type
checker: here every source holds a value no other one holds.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from gateway.config.policies import DecodeWorker, PrefillWorker
from gateway.core.generation import Outcome, Trace
from gateway.tenancy.auth import Principal
from gateway.workers.capacity import WorkerCapacity
from gateway.workers.pairs import WorkerPair


def _pair() -> WorkerPair:
    prefill = PrefillWorker(url="http://prefill:1", bootstrap_port=2)
    decode = DecodeWorker(url="http://decode:1")
    return WorkerPair(
        "pool-a",
        prefill,
        decode,
        WorkerCapacity(prefill.url, "prefill", 0.0, 1000, None, None, 1, 0, None, None),
        WorkerCapacity(decode.url, "decode", 0.0, 1000, None, None, 1, 0, None, None),
    )


def test_audit_event_fields_each_come_from_their_own_source() -> None:
    created = datetime(2026, 12, 5, 7, 0, tzinfo=UTC)
    trace = Trace("gen-1", created, time.perf_counter(), stream=True, model="model-m")
    trace.principal = Principal("tenant-t", "key-k", is_admin=False)
    trace.pair = _pair()
    trace.prompt_tokens, trace.completion_tokens = 11, 22
    event = trace.event(Outcome("rejected", 429, "code-c", "detail-d"))
    assert event.generation_id == "gen-1"
    assert (event.tenant_id, event.key_id) == ("tenant-t", "key-k")
    assert event.model == "model-m"
    assert (event.outcome, event.status, event.code, event.detail) == (
        "rejected",
        429,
        "code-c",
        "detail-d",
    )
    assert (event.prefill_worker, event.decode_worker, event.pool) == (
        "http://prefill:1",
        "http://decode:1",
        "pool-a",
    )
    assert (event.prompt_tokens, event.completion_tokens) == (11, 22)
    assert event.stream is True
    assert event.created_at == created
    assert 0.0 <= event.latency_ms < 60_000.0


def test_an_audit_event_before_auth_and_routing_names_no_tenant_key_or_workers() -> None:
    trace = Trace("gen-2", datetime.now(UTC), time.perf_counter())
    event = trace.event(Outcome("rejected", 400, "invalid_json"))
    assert (event.tenant_id, event.key_id) == ("", None)
    assert (event.prefill_worker, event.decode_worker, event.pool) == (None, None, None)
    assert (event.model, event.prompt_tokens, event.completion_tokens) == (None, None, None)
    assert event.stream is False
