"""A prompt whose byte length alone proves it over the limit is refused without tokenizing it."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import StandInWorker


def untokenized_refusals(gateway: GatewayProcess) -> float:
    text = httpx.get(
        gateway.url + "/metrics", headers={"Authorization": f"Bearer {gateway.admin_key}"}
    ).text
    return sum(
        float(v)
        for v in re.findall(
            r"^isogate_admission_refused_untokenized_total\{[^}]*\} (\S+)$", text, re.M
        )
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    work = tmp_path_factory.mktemp("cheap")
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    policies = write_policies(
        work / "policies",
        model_name="m",
        tokenizer_dir=ensure_tiny_model(),
        pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
    )
    with GatewayProcess(
        policies, work, env={"ISOGATE_MAX_BODY_BYTES": str(64 * 1024 * 1024)}
    ) as process:
        process.stand_ins = (prefill, decode)
        yield process
    prefill.stop()
    decode.stop()


def test_a_50_mb_prompt_is_refused_on_its_byte_length_without_tokenizing(
    gateway: GatewayProcess,
) -> None:
    _, key = gateway.create_tenant()
    before = untokenized_refusals(gateway)
    prompt = "x" * (50 * 1024 * 1024)
    started = time.perf_counter()
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    elapsed = time.perf_counter() - started
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "at least" in error["message"]  # a bound from the byte length, not a token count
    assert untokenized_refusals(gateway) == before + 1
    assert not any(r for w in gateway.stand_ins for r in w.requests)  # no worker was contacted
    print(f"refused 50 MB in {elapsed * 1000:.0f} ms end to end (timing is reported by make bench)")


def test_a_prompt_near_the_limit_is_tokenized_and_counted_exactly(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant()
    before = untokenized_refusals(gateway)
    # 9,000 distinct-ish bytes: the byte bound cannot prove it too long (a token may span
    # several bytes), so it is tokenized; its exact count decides.
    prompt = " ".join(f"w{i}" for i in range(2000))
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert "at least" not in response.json()["error"]["message"]
    assert untokenized_refusals(gateway) == before


def test_a_body_over_the_configured_size_is_413(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant()
    response = httpx.post(
        gateway.url + "/v1/completions",
        content=b"x" * (65 * 1024 * 1024),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
