"""The canary prober, end to end against stand-in workers: it probes every pair as ``__canary__``,
and a worker that leaks its marker into another tenant's answer gets that answer withheld.

The leak itself is staged by the stand-in (real SGLang cannot be made to leak on cue): the
test reads the marker out of the canary prompt the decode stand-in received and has the
stand-in write it into a tenant's answer, which is what a stale-KV read would look like.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.common.ids import is_generation_id
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.service.canary import CANARY_TENANT_ID
from gateway.verification.scanner import MARKER_LENGTH, MARKER_PREFIX
from tests.standin_worker import Behaviour
from tests.verification.stack import MODEL, POOL_TOKENS, LyingStack, lying_stack, wait_until

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say something."}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingStack]:
    env = {"ISOGATE_CANARY_INTERVAL_S": "0.3", "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.05"}
    with lying_stack(tmp_path_factory.mktemp("prober"), env=env) as running:
        yield running


def canary_requests(stack: LyingStack) -> list[dict[str, Any]]:
    return [
        r
        for r in stack.decode.requests
        if r["_headers"].get("x-isolation-tenant") == CANARY_TENANT_ID
    ]


def marker_of(request: dict[str, Any]) -> str:
    tokenizer = Tokenizer.from_file(str(ensure_tiny_model(DEFAULT_MODEL_DIR) / "tokenizer.json"))
    prompt = tokenizer.decode(request["input_ids"])
    found = re.search(
        re.escape(MARKER_PREFIX) + f".{{{MARKER_LENGTH - len(MARKER_PREFIX)}}}", prompt
    )
    assert found, prompt
    return found.group(0)


def test_the_prober_sends_tagged_canaries_with_their_own_salt_to_both_workers(
    stack: LyingStack,
) -> None:
    assert wait_until(lambda: len(canary_requests(stack)) >= 2, timeout_s=15)
    probe = canary_requests(stack)[0]
    assert (
        is_generation_id(probe["rid"])
        and probe["_headers"]["x-isolation-generation"] == probe["rid"]
    )
    assert any(
        r["rid"] == probe["rid"] for r in stack.prefill.requests
    )  # the prefill half of the same pair
    assert len({r["rid"] for r in canary_requests(stack)}) == len(
        canary_requests(stack)
    )  # fresh IDs ...
    assert len({marker_of(r) for r in canary_requests(stack)[:3]}) == min(
        3, len(canary_requests(stack))
    )  # markers
    tenant_id, key = stack.gateway.create_tenant()
    with stack.client(key) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    tenant_request = next(
        r
        for r in reversed(stack.decode.requests)
        if r["_headers"]["x-isolation-tenant"] == tenant_id
    )
    assert (
        tenant_request["extra_key"] != probe["extra_key"]
    )  # the canary never shares a tenant's prefix cache
    assert wait_until(
        lambda: stack.metric("isogate_canary_probes_total", outcome="passed") >= 1, timeout_s=5
    )
    assert stack.metric("isogate_canary_live_markers") >= 1


def test_a_probe_marker_in_a_tenants_answer_is_withheld_and_raises_the_alert(
    stack: LyingStack,
) -> None:
    assert wait_until(lambda: canary_requests(stack), timeout_s=15)
    marker = marker_of(canary_requests(stack)[-1])
    _, key = stack.gateway.create_tenant()
    stack.decode.behaviour = Behaviour(
        pool_tokens=POOL_TOKENS, text_chunks=("stale page says ", marker)
    )
    try:
        hits_before = stack.metric("isogate_canary_hits_total")
        with stack.client(key) as client:
            response = client.post("/v1/chat/completions", json=CHAT)
    finally:
        stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS)
    assert (
        response.status_code == 502 and response.json()["error"]["code"] == "isolation_check_failed"
    )
    assert marker not in response.text and "stale page" not in response.text
    assert stack.metric("isogate_canary_hits_total") >= hits_before + 1
    assert wait_until(lambda: "CANARY HIT" in stack.gateway.log_path.read_text(), timeout_s=5)
    alert = next(
        line for line in stack.gateway.log_path.read_text().splitlines() if "CANARY HIT" in line
    )
    assert f'"marker_owner":"{CANARY_TENANT_ID}"' in alert and marker in alert


def test_a_probe_that_gets_a_lying_answer_is_audited_under_the_canary_tenant(
    stack: LyingStack,
) -> None:
    def lies_audited() -> list[dict[str, Any]]:
        with stack.gateway.admin() as admin:
            events = admin.get(
                "/v1/audit/events",
                params={"tenant": CANARY_TENANT_ID, "outcome": "verification_failed"},
            ).json()["data"]
        return [e for e in events if e["detail"] == "engine echoed another tenant"]

    failed_before = stack.metric("isogate_canary_probes_total", outcome="verification_failed")
    stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS, wrong_tenant=True)
    try:
        found = wait_until(lies_audited, timeout_s=15)
    finally:
        stack.decode.behaviour = Behaviour(pool_tokens=POOL_TOKENS)
    assert found and found[0]["decode_worker"] == stack.decode.url and found[0]["status"] == 502
    assert (
        stack.metric("isogate_canary_probes_total", outcome="verification_failed") > failed_before
    )


def test_the_canary_tenant_cannot_be_created_by_an_admin(stack: LyingStack) -> None:
    with stack.gateway.admin() as admin:
        response = admin.post("/admin/tenants", json={"id": CANARY_TENANT_ID})
    assert response.status_code == 400
