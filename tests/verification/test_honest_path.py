"""The honest path against REAL SGLang (PD on the CPU, with engine_patch): every check passes.

A run of many requests (two tenants, streamed and not, chat and completions) with the canary
prober probing the same pair raises no false alarm: no verification failure, no canary hit,
every probe passes. And SGLang's own ``cached_tokens`` shows that the per-tenant cache salt
keeps prefix-cache reuse inside a tenant: the same prompt is a cache hit for the tenant that
sent it before and a cold prefill for the other.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from gateway.dev.harness import GatewayProcess
from tests.conftest import MODEL
from tests.harness import PoolSpec, write_policies
from tests.verification.stack import gateway_metric, sse_events, start_gateway, wait_until

pytestmark = pytest.mark.engine

REQUIRE_TAGS = os.environ.get("ISOGATE_TEST_REQUIRE_ENGINE_TAGS", "1") == "1"
RUNS = 50


@pytest.fixture(scope="module")
def probed_gateway(
    pd_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway of our own in front of the session pair, with the canary prober on."""
    work = tmp_path_factory.mktemp("probed-gateway")
    policies = write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=pd_cluster.spec.model_dir,
        pools=[
            PoolSpec(
                "shared",
                ((pd_cluster.prefill_url, pd_cluster.bootstrap_port),),
                (pd_cluster.decode_url,),
            )
        ],
        require_engine_tags=REQUIRE_TAGS,
    )
    gateway = start_gateway(
        policies,
        work,
        {"ISOGATE_CANARY_INTERVAL_S": "0.5", "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.05"},
    )
    try:
        yield gateway
    finally:
        gateway.stop()


def one_request(
    gateway: GatewayProcess, key: str, index: int, tokenizer: Tokenizer
) -> dict[str, Any]:
    stream, chat = index % 3 != 0, index % 2 == 0
    max_tokens = 1 + index % 12
    words = f"Request {index}: tell me about {secrets.token_hex(4)} and the number {index * 7}."
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0 if index % 4 else 0.7,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", gateway.url + path, json=body, headers=headers, timeout=120
    ) as response:
        response.read()
        if not stream:
            return {
                "status": response.status_code,
                "json": response.json(),
                "stream": False,
                "chat": chat,
                "max_tokens": max_tokens,
                "prompt_ids": None if chat else len(tokenizer.encode(words).ids),
            }
        return {
            "status": response.status_code,
            "events": sse_events(response),
            "stream": True,
            "chat": chat,
            "max_tokens": max_tokens,
            "prompt_ids": None if chat else len(tokenizer.encode(words).ids),
        }


def test_many_mixed_requests_from_two_tenants_pass_every_check(
    probed_gateway: GatewayProcess, pd_cluster: Any
) -> None:
    gateway = probed_gateway

    def metric(name: str, **labels: str) -> float:
        return gateway_metric(gateway, name, **labels)

    tokenizer = Tokenizer.from_file(str(pd_cluster.spec.model_dir / "tokenizer.json"))
    tenants = [gateway.create_tenant() for _ in range(2)]
    wait_routable(gateway, tenants[0][1])
    assert wait_until(
        lambda: metric("isogate_canary_probes_total", outcome="passed") >= 1, timeout_s=30
    ), "the prober never passed against the real pair"
    assert metric("isogate_canary_live_markers") >= 1  # the scan below runs against live markers

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda i: one_request(gateway, tenants[i % 2][1], i, tokenizer), range(RUNS))
        )

    for result in results:
        assert result["status"] == 200, result
        if result["stream"]:
            events = result["events"]
            assert events[-1] == "[DONE]" and not any(
                isinstance(e, dict) and "error" in e for e in events
            )
            usage = events[-2]["usage"]
        else:
            usage = result["json"]["usage"]
        assert 0 < usage["completion_tokens"] <= result["max_tokens"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
        if result["prompt_ids"] is not None:
            assert usage["prompt_tokens"] == result["prompt_ids"]
    assert metric("isogate_verification_failures_total") == 0
    assert metric("isogate_canary_hits_total") == 0
    assert metric("isogate_canary_probes_total", outcome="verification_failed") == 0
    assert metric("isogate_canary_probes_total", outcome="passed") >= 2
    for _, key in tenants:
        with httpx.Client(
            base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}
        ) as client:

            def audited() -> list[dict[str, Any]]:
                events = client.get("/v1/audit/events").json()["data"]
                return events if len(events) >= RUNS // 2 else []

            events = wait_until(audited, timeout_s=10)
        assert len(events) == RUNS // 2 and {e["outcome"] for e in events} == {"served"}


def wait_routable(gateway: GatewayProcess, key: str) -> None:
    """Until the gateway has fresh capacity data for a pair this tenant may use (a busy machine
    can delay the polls); /v1/models shows null limits while it has none."""

    def routable() -> bool:
        models = httpx.get(
            gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        return any(m["id"] == MODEL and m.get("max_context_tokens") for m in models.json()["data"])

    assert wait_until(routable, timeout_s=30), "no routable pair"


def cached_tokens(gateway: GatewayProcess, key: str, prompt: str) -> tuple[int, int]:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens


def test_the_same_long_prefix_is_reused_within_a_tenant_and_never_across(
    gateway: GatewayProcess,
) -> None:
    (_, key_a), (_, key_b) = gateway.create_tenant(), gateway.create_tenant()
    wait_routable(gateway, key_a)
    # Unique per run, so nothing cached by an earlier run can answer for it.
    prefix = f"Shared document {secrets.token_hex(8)}. " + " ".join(
        f"Clause {n} reads {secrets.token_hex(3)}." for n in range(60)
    )

    a_cold, prompt_tokens = cached_tokens(gateway, key_a, prefix + " First question?")
    a_warm, _ = cached_tokens(gateway, key_a, prefix + " Second question?")
    b_same_prompt, _ = cached_tokens(
        gateway, key_b, prefix + " First question?"
    )  # exactly A's first prompt
    b_warm, _ = cached_tokens(gateway, key_b, prefix + " Third question?")
    print(
        f"prompt {prompt_tokens} tokens; cached: A cold {a_cold}, A again {a_warm}, "
        f"B same prompt as A {b_same_prompt}, B again {b_warm}"
    )

    assert prompt_tokens > 300
    assert a_cold == 0
    assert a_warm >= prompt_tokens * 0.9  # the tenant's own prefix is reused ...
    assert b_same_prompt == 0  # ... the identical prompt from another tenant reuses nothing
    assert b_warm >= prompt_tokens * 0.9  # and B's own cache works for B
