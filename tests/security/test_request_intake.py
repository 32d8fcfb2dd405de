"""What a request costs before anything is known about it: a hostile body must not stall other
tenants, a tenant out of requests is refused before its body is looked at, and requests
without a valid key are counted and rate-limited per address but never written to the audit log.

One gateway process in front of stand-in workers, with a small request rate for every tenant
and a small allowance of failed authentications per address.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.reliability.stack import MODEL, StandInStack, chat_body, standin_stack
from tests.security.checks import assert_clean_error

REQUESTS_PER_MINUTE = 3
UNAUTHENTICATED_PER_MINUTE = 5
# The hostile body: 2,000,000 tiny messages, 60 MB.
HOSTILE_MESSAGES = 2_000_000


@pytest.fixture(scope="module")
def intake_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInStack]:
    with standin_stack(
        tmp_path_factory.mktemp("intake"),
        env={
            "ISOGATE_MAX_BODY_BYTES": str(64 * 1024 * 1024),
            "ISOGATE_UNAUTHENTICATED_PER_ADDRESS_PER_MINUTE": str(UNAUTHENTICATED_PER_MINUTE),
        },
        default_limits={
            "requests_per_minute": REQUESTS_PER_MINUTE,
            "tokens_per_minute": 100_000_000,
            "max_concurrent": 100,
        },
    ) as running:
        yield running


def hostile_body() -> bytes:
    message = orjson.dumps({"role": "user", "content": "x"})
    return (
        b'{"model": "'
        + MODEL.encode()
        + b'", "messages": ['
        + b",".join([message] * HOSTILE_MESSAGES)
        + b"]}"
    )


def test_the_loop_keeps_answering_while_a_60_mb_body_is_refused(intake_stack: StandInStack) -> None:
    body = hostile_body()
    uploaded = threading.Event()
    answered = threading.Event()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]
        uploaded.set()  # asked for more after the last chunk: all of it was written

    def probe_health() -> tuple[list[int], int]:
        """Every /healthz status, and how many were asked after the body was in and answered
        before the body's refusal came back. Checked by the test: an assert failing here
        would end only this thread."""
        statuses: list[int] = []
        meanwhile = 0
        with httpx.Client(base_url=intake_stack.gateway.url, timeout=60) as client:
            while not answered.is_set():
                was_uploaded = uploaded.is_set()
                statuses.append(client.get("/healthz").status_code)
                if was_uploaded and not answered.is_set():
                    meanwhile += 1
        return statuses, meanwhile

    with ThreadPoolExecutor(1) as pool:
        prober = pool.submit(probe_health)
        try:
            with intake_stack.client(intake_stack.key("hostile-body"), timeout_s=120) as client:
                refused = client.post(
                    "/v1/chat/completions",
                    content=chunks(),
                    headers={"Content-Type": "application/json"},
                )
        finally:
            answered.set()
        statuses, answers_meanwhile = prober.result()  # raises what the prober raised
    assert_clean_error(refused.status_code, refused.content, statuses=(400,))
    assert refused.json()["error"]["param"] == "messages"
    assert statuses and set(statuses) == {200}, f"/healthz answered {sorted(set(statuses))}"
    assert answers_meanwhile >= 2, "the event loop did not answer while the body was processed"


def test_a_tenant_out_of_requests_gets_429_for_any_body(intake_stack: StandInStack) -> None:
    with intake_stack.client(intake_stack.key("out-of-requests"), timeout_s=60) as client:
        for _ in range(REQUESTS_PER_MINUTE):
            assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        invalid = client.post(
            "/v1/chat/completions",
            content=b'{"model": ',
            headers={"Content-Type": "application/json"},
        )
        over_context = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "word " * 40_000, "max_tokens": 4}
        )
        huge = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x" * (15 * 1024 * 1024), "max_tokens": 4},
        )
    for answer in (invalid, over_context, huge):
        assert_clean_error(answer.status_code, answer.content, statuses=(429,))
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(answer.headers["retry-after"]) >= 1


def _unauthenticated_count(stack: StandInStack) -> float:
    with stack.gateway.admin() as admin:
        text = admin.get("/metrics").text
    return sum(
        float(value)
        for value in re.findall(
            r"^isogate_unauthenticated_requests_total\{[^}]*\} (\S+)$", text, re.M
        )
    )


def _anonymous_audit_events(stack: StandInStack) -> list[dict[str, object]]:
    with stack.gateway.admin() as admin:
        page = admin.get("/v1/audit/events", params={"limit": "1000"})
    page.raise_for_status()
    return [event for event in page.json()["data"] if event["tenant"] in ("", None)]


def test_unauthenticated_requests_are_counted_limited_and_never_audited(
    intake_stack: StandInStack,
) -> None:
    before = _unauthenticated_count(intake_stack)
    statuses = []
    for attempt in range(UNAUTHENTICATED_PER_MINUTE + 3):
        headers = {} if attempt % 2 else {"Authorization": f"Bearer sk-iso-made-up-{attempt}"}
        with httpx.Client(base_url=intake_stack.gateway.url, headers=headers, timeout=30) as anon:
            answer = anon.post("/v1/chat/completions", json=chat_body())
        statuses.append(answer.status_code)
        assert_clean_error(answer.status_code, answer.content, statuses=(401, 429))
    assert statuses[:UNAUTHENTICATED_PER_MINUTE] == [401] * UNAUTHENTICATED_PER_MINUTE
    assert set(statuses[UNAUTHENTICATED_PER_MINUTE:]) == {429}
    assert _unauthenticated_count(intake_stack) - before == len(statuses)
    assert _anonymous_audit_events(intake_stack) == []
