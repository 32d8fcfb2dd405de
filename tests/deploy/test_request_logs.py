"""Structured JSON logs: every line logged while a request is served carries its generation ID,
whichever module logs it (the request path, dispatch, or the upstream HTTP client); the log
file is readable by its owner only."""

from __future__ import annotations

import stat
import time

from tests.deploy.conftest import chat, log_lines, log_size


def _quiet_background() -> dict[str, str]:
    # Debug level makes the request path log from several modules; capacity polls and audit
    # flushes are pushed past the test's window so every line in it belongs to the request.
    return {
        "ISOGATE_LOG_LEVEL": "debug",
        "ISOGATE_CAPACITY_POLL_INTERVAL_S": "60",
        "ISOGATE_CAPACITY_STALE_AFTER_S": "300",
        "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "60",
    }


def _window(gateway, request) -> tuple[object, list[dict]]:
    time.sleep(0.5)  # let start-up and tenant-creation lines land before the window opens
    offset = log_size(gateway)
    response = request()
    time.sleep(0.5)
    return response, log_lines(gateway, offset)


def test_every_log_line_of_a_served_request_carries_its_generation_id(start_gateway) -> None:
    gateway = start_gateway(**_quiet_background())
    _, key = gateway.create_tenant()

    response, lines = _window(gateway, lambda: chat(gateway, key))

    assert response.status_code == 200
    generation_id = response.json()["id"]
    assert lines, "debug logging of a served request produced no line: the check would be vacuous"
    assert {"isogate.request", "gateway.workers.dispatch", "gateway.workers.upstream"} <= {
        line["logger"] for line in lines
    }, (
        "expected lines from the request path, dispatch, and the HTTP client "
        "(which knows nothing of generations)"
    )
    for line in lines:
        assert line.get("generation_id") == generation_id, line
        assert {"ts", "level", "logger", "message"} <= line.keys()


def test_an_isolation_failure_logs_its_generation_id_and_reason(
    start_gateway, standin_pair
) -> None:
    gateway = start_gateway(**_quiet_background())
    _, key = gateway.create_tenant()
    standin_pair.decode.behaviour.wrong_tenant = True

    response, lines = _window(gateway, lambda: chat(gateway, key))

    assert response.status_code == 502
    generation_ids = {line.get("generation_id") for line in lines}
    assert len(generation_ids) == 1 and None not in generation_ids
    failures = [line for line in lines if line["message"] == "isolation check failed"]
    assert len(failures) == 1 and failures[0]["level"] == "error" and failures[0]["reason"]


def test_at_info_a_refused_request_logs_its_line_and_a_served_one_only_its_audit_event(
    start_gateway,
) -> None:
    gateway = start_gateway(**{**_quiet_background(), "ISOGATE_LOG_LEVEL": "info"})
    _, key = gateway.create_tenant()

    served, served_lines = _window(gateway, lambda: chat(gateway, key))
    refused, refused_lines = _window(gateway, lambda: chat(gateway, key, model="no-such-model"))

    assert served.status_code == 200 and refused.status_code == 404
    assert [line for line in served_lines if line["message"] == "request finished"] == []
    finished = [line for line in refused_lines if line["message"] == "request finished"]
    assert (
        len(finished) == 1 and finished[0]["outcome"] == "rejected" and finished[0]["status"] == 404
    )
    assert finished[0]["generation_id"] == refused.headers["X-Generation-Id"]


def test_the_gateways_log_file_is_readable_by_its_owner_only(start_gateway) -> None:
    gateway = start_gateway()
    _, key = gateway.create_tenant()
    assert chat(gateway, key).status_code == 200  # a request's lines are in it

    assert stat.S_IMODE(gateway.log_path.stat().st_mode) == 0o600
