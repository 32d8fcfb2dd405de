"""A non-streaming client that hangs up is noticed: aborted on both real SGLang workers, its
claims released, its audit event ``client_cancelled`` 499 (issue 17, finding 3)."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL

pytestmark = pytest.mark.engine

MAX_TOKENS = 1024  # free text of the dev model runs to max_tokens: many seconds on this CPU


def _decode_tokens(worker_url: str) -> float:
    """Tokens decoded by the worker so far (SGLang's ``realtime_tokens_total``, decode mode)."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(
        float(value)
        for value in re.findall(
            r'^sglang:realtime_tokens_total\{[^}]*mode="decode"[^}]*\} (\S+)$', text, re.M
        )
    )


def _busy(worker_url: str) -> int:
    """Requests the worker holds in any queue or batch (SGLang's ``/v1/loads``)."""
    loads = httpx.get(worker_url + "/v1/loads", timeout=10).json()["loads"]
    held = 0
    for rank in loads:
        held += rank["num_running_reqs"] + rank["num_waiting_reqs"]
        held += sum(v for k, v in rank.get("disaggregation", {}).items() if k.endswith("_reqs"))
    return held


def _wait(predicate: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def test_a_non_streaming_client_that_hangs_up_is_aborted_on_both_workers(
    gateway: GatewayProcess, pd_cluster: Any
) -> None:
    tenant_id, key = gateway.create_tenant()
    decoded_before = _decode_tokens(pd_cluster.decode_url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    with pytest.raises(httpx.ReadTimeout):  # the client leaves while the workers generate
        httpx.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(10, read=0.3),
        )

    def events() -> list[dict[str, Any]]:
        with gateway.admin() as admin:
            data: list[dict[str, Any]] = admin.get(
                "/v1/audit/events", params={"tenant": tenant_id}
            ).json()["data"]
            return data

    # Recorded when the request ended: at once when the hang-up is noticed, else after the
    # whole generation.
    recorded = _wait(events, timeout_s=120)
    assert [(e["outcome"], e["status"]) for e in recorded] == [("client_cancelled", 499)]
    with gateway.admin() as admin:
        claimed = {
            w["url"]: w["claimed_tokens"] for w in admin.get("/admin/workers").json()["data"]
        }
    assert claimed == {pd_cluster.prefill_url: 0, pd_cluster.decode_url: 0}
    # Both workers let go of it, and decode stopped short of the tokens it was asked for.
    assert _wait(
        lambda: _busy(pd_cluster.prefill_url) == 0 and _busy(pd_cluster.decode_url) == 0,
        timeout_s=120,
    )
    decoded = _decode_tokens(pd_cluster.decode_url) - decoded_before
    assert decoded < MAX_TOKENS / 2, f"decode went on to {decoded} tokens after the client left"
