"""The dev and test workers run with the priority scheduling the fair queue's order needs."""

from __future__ import annotations

from gateway.config.settings import Settings
from gateway.core.fair_queue import ENGINE_DEFAULT_PRIORITY
from gateway.dev.cluster import CPU_SERVER_ARGS


def _value(flag: str) -> str:
    return CPU_SERVER_ARGS[CPU_SERVER_ARGS.index(flag) + 1]


def test_workers_schedule_and_retract_by_the_priority_the_gateway_sends() -> None:
    assert "--enable-priority-scheduling" in CPU_SERVER_ARGS
    assert _value("--retraction-policy") == "priority"
    # Larger first (SGLang's default direction), as fair_queue.engine_priority counts.
    assert "--schedule-low-priority-values-first" not in CPU_SERVER_ARGS
    # A request sent without one (the canary, SGLang's health check) is normal work.
    assert int(_value("--default-priority-value")) == ENGINE_DEFAULT_PRIORITY


def test_decode_reserves_no_more_per_request_than_the_gateways_admission_margin() -> None:
    # The gateway claims each request's prompt + max_tokens + margin of the pool before it
    # reaches the workers; a larger reserve in decode kept such requests waiting there.
    reserve = int(_value("--num-reserved-decode-tokens"))
    assert reserve <= Settings().admission_safety_margin_tokens
