"""The dev and test workers run with the priority scheduling the fair queue's order needs."""

from __future__ import annotations

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
