"""Gate 1 on real SGLang in the incident's shape: prefill pool < context length < decode pool.

The engine here is deliberately misconfigured and its own guards are switched off
(``ISOGATE_ENGINE_DISABLE_CHECKS=gate,guard``), so the only thing between an over-pool prompt
and the incident is the gateway. That the workers never received a refused prompt is read
from SGLang itself: its HTTP access log (``POST /generate`` lines) and its scheduler counters.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.dev.cluster import PDCluster, default_cluster_spec
from gateway.dev.harness import GatewayProcess
from tests.harness import REPO_ROOT, PoolSpec, write_policies

pytestmark = pytest.mark.engine

MODEL = "incident-llama"
PREFILL_POOL, DECODE_POOL, CONTEXT_LENGTH = 2048, 8192, 4096
MAX_TOKENS, MARGIN = 16, 16
SCHEDULER_COUNTERS = (
    "sglang:per_stage_req_latency_seconds_count",
    "sglang:queue_time_seconds_count",
    "sglang:realtime_tokens_total",
    "sglang:kv_transfer_latency_ms_count",
)


@pytest.fixture(scope="module")
def incident_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    spec = default_cluster_spec(
        log_dir=tmp_path_factory.mktemp("incident-logs"),
        prefill_port=32200,
        decode_port=32201,
        bootstrap_port=32202,
        prefill_max_total_tokens=PREFILL_POOL,
        decode_max_total_tokens=DECODE_POOL,
        context_length=CONTEXT_LENGTH,
    )
    # The incident's misconfiguration, with the engine's own pool checks off: gate 1 alone.
    unguarded = {"ISOGATE_ENGINE_DISABLE_CHECKS": "gate,guard"}
    spec = dataclasses.replace(
        spec,
        prefill=dataclasses.replace(spec.prefill, env={**spec.prefill.env, **unguarded}),
        decode=dataclasses.replace(spec.decode, env={**spec.decode.env, **unguarded}),
    )
    with PDCluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def incident_gateway(
    incident_cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    work = tmp_path_factory.mktemp("incident-gateway")
    policies = write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=incident_cluster.spec.model_dir,
        pools=[
            PoolSpec(
                "shared",
                ((incident_cluster.prefill_url, incident_cluster.bootstrap_port),),
                (incident_cluster.decode_url,),
            )
        ],
    )
    with GatewayProcess(
        policies_dir=policies,
        work_dir=work,
        env={"ISOGATE_ADMISSION_SAFETY_MARGIN_TOKENS": str(MARGIN)},
    ) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def key(incident_gateway: GatewayProcess) -> str:
    return incident_gateway.create_tenant()[1]


def generate_requests_seen(cluster: PDCluster) -> dict[str, int]:
    """What SGLang itself recorded, per worker: access-log lines for /generate and scheduler
    counters."""
    seen: dict[str, int] = {}
    for role, url in (("prefill", cluster.prefill_url), ("decode", cluster.decode_url)):
        log = cluster.logs[role].read_text(errors="replace")
        seen[f"{role} access log"] = len(re.findall(r'"POST /generate HTTP', log))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        for counter in SCHEDULER_COUNTERS:
            values = re.findall(rf"^{re.escape(counter)}{{[^}}]*}} ([0-9.e+]+)$", metrics, re.M)
            seen[f"{role} {counter}"] = int(sum(float(v) for v in values))
    return seen


def expected_limit(cluster: PDCluster) -> int:
    """The limit computed here from the workers' own numbers, independently of the gateway."""
    infos = [
        httpx.get(url + "/server_info", timeout=10).json()
        for url in (cluster.prefill_url, cluster.decode_url)
    ]
    bounds = [
        PREFILL_POOL - MAX_TOKENS - MARGIN,
        DECODE_POOL - MAX_TOKENS - MARGIN,
        CONTEXT_LENGTH - MAX_TOKENS,
    ]
    bounds += [info["max_req_input_len"] for info in infos]
    return min(bounds)


def test_a_prompt_between_the_pools_is_refused_before_any_worker_sees_it(
    incident_cluster: PDCluster, incident_gateway: GatewayProcess, key: str
) -> None:
    client = openai.OpenAI(base_url=incident_gateway.url + "/v1", api_key=key, max_retries=0)
    prompt = [
        5 + (i % 400) for i in range(3000)
    ]  # over the prefill pool, under context and decode pool
    assert PREFILL_POOL < len(prompt) < CONTEXT_LENGTH < DECODE_POOL
    before = generate_requests_seen(incident_cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
    error = refused.value.body
    assert refused.value.status_code == 400
    assert error["code"] == "context_length_exceeded"
    assert "3000" in error["message"] and "prefill KV pool" in error["message"]
    assert str(expected_limit(incident_cluster)) in error["message"]
    # A chat prompt of the same size, and a stream, are refused the same way.
    text = "lorem ipsum dolor sit amet " * 400
    for stream in (False, True):
        response = httpx.post(
            incident_gateway.url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": MAX_TOKENS,
                "stream": stream,
            },
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert generate_requests_seen(incident_cluster) == before


def test_prompts_one_token_under_and_over_the_limit_land_on_the_right_side(
    incident_cluster: PDCluster, incident_gateway: GatewayProcess, key: str
) -> None:
    limit = expected_limit(incident_cluster)
    client = openai.OpenAI(
        base_url=incident_gateway.url + "/v1", api_key=key, max_retries=0, timeout=120
    )
    at_limit = [7 + (i % 300) for i in range(limit)]
    served = client.completions.create(
        model=MODEL, prompt=at_limit, max_tokens=MAX_TOKENS, temperature=0
    )
    assert served.usage.prompt_tokens == limit
    before = generate_requests_seen(incident_cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[*at_limit, 9], max_tokens=MAX_TOKENS)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert generate_requests_seen(incident_cluster) == before
    # A smaller max_tokens leaves room for exactly that many more prompt tokens.
    served = client.completions.create(
        model=MODEL, prompt=[*at_limit, 9], max_tokens=MAX_TOKENS - 1, temperature=0
    )
    assert served.usage.prompt_tokens == limit + 1


def test_models_reports_the_effective_context_set_by_the_prefill_pool(
    incident_gateway: GatewayProcess, key: str
) -> None:
    models = httpx.get(
        incident_gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}
    ).json()
    card = next(m for m in models["data"] if m["id"] == MODEL)
    assert card["max_context_bound"] == "prefill KV pool"
    assert card["max_context_tokens"] == PREFILL_POOL - MARGIN
    assert card["max_context_tokens"] < CONTEXT_LENGTH


def test_check_pools_fails_on_the_incident_shaped_cluster(incident_cluster: PDCluster) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "check-pools",
            "--worker",
            f"prefill={incident_cluster.prefill_url}",
            "--worker",
            f"decode={incident_cluster.decode_url}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    prefill_row = next(
        line for line in result.stdout.splitlines() if incident_cluster.prefill_url in line
    )
    assert f"FAIL context length {CONTEXT_LENGTH} > KV pool {PREFILL_POOL}" in prefill_row
    decode_row = next(
        line for line in result.stdout.splitlines() if incident_cluster.decode_url in line
    )
    assert decode_row.rstrip().endswith("ok")
