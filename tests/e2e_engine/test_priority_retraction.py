"""Priority scheduling on a real SGLang PD pair on the CPU, as the gateway's workers run it
(gateway.dev.cluster's flags), with engine_patch: the workers say priority scheduling is on,
and a decode retraction (forced every few steps by SGLang's own SGLANG_TEST_RETRACT) takes
the lower priority request first, which resumes from its host backup and is verified again
before it decodes on: both answers whole, verified, with their own tags."""

from __future__ import annotations

import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.cluster import PDCluster, default_cluster_spec
from tests.e2e_engine.pd_pairs import (
    CPU_SHIM_PLUGIN,
    ENGINE_PATCH_PLUGIN,
    SHORT_DISAGG_TIMEOUTS,
    engine_log_lines,
    incident_prompt,
    plugin_env,
    refusals,
)

pytestmark = pytest.mark.engine

PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT = 30140, 30141, 30142
# The lower priority request is sent first and is long enough to still be decoding when the
# higher one joins it, however slowly a loaded host prefills and transfers the second: the
# retraction only chooses between requests that decode together (alone, one is always kept).
LOW_TOKENS, HIGH_TOKENS = 600, 48
DECODE_STARTED_WAIT_S = 60


def forced_retraction_pair(tmp_path: Path) -> PDCluster:
    spec = default_cluster_spec(
        log_dir=tmp_path / "logs",
        prefill_port=PREFILL_PORT,
        decode_port=DECODE_PORT,
        bootstrap_port=BOOTSTRAP_PORT,
    )
    env = {**plugin_env(CPU_SHIM_PLUGIN, ENGINE_PATCH_PLUGIN), **SHORT_DISAGG_TIMEOUTS}
    return PDCluster(
        dataclasses.replace(
            spec,
            prefill=dataclasses.replace(spec.prefill, env=env),
            decode=dataclasses.replace(spec.decode, env={**env, "SGLANG_TEST_RETRACT": "1"}),
        )
    )


def generate(
    cluster: PDCluster, generation: str, priority: int, room: int, tokens: int
) -> dict[str, Any]:
    """One request as the gateway sends it: the same body, priority included, to both."""
    body = {
        "input_ids": incident_prompt(40),
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "rid": generation,
        "extra_key": f"salt-{generation}",
        "stream": False,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.bootstrap_port,
        "bootstrap_room": room,
        "priority": priority,
    }
    headers = {"X-Isolation-Tenant": f"tenant-{generation}", "X-Isolation-Generation": generation}
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(
            client.post, f"{cluster.prefill_url}/generate", json=body, headers=headers
        )
        decode = pool.submit(
            client.post, f"{cluster.decode_url}/generate", json=body, headers=headers
        )
        assert prefill.result().status_code == 200, prefill.result().text
        answer = decode.result()
        assert answer.status_code == 200, answer.text
        meta: dict[str, Any] = answer.json()["meta_info"]
        return meta


def wait_until_decode_verified(cluster: PDCluster, generation: str) -> None:
    """Until decode has verified the request's transferred pages: it decodes from then on."""
    deadline = time.monotonic() + DECODE_STARTED_WAIT_S
    line = f"verified rid={generation} "
    while not any(line in entry for entry in engine_log_lines(cluster, "decode")):
        assert time.monotonic() < deadline, f"decode never verified {generation}"
        time.sleep(0.05)


def test_a_retracted_lower_priority_request_resumes_verified_with_its_tags(tmp_path: Path) -> None:
    with forced_retraction_pair(tmp_path) as cluster:
        for url in (cluster.prefill_url, cluster.decode_url):
            info = httpx.get(f"{url}/server_info", timeout=30).json()
            assert info["enable_priority_scheduling"] is True
            assert info["retraction_policy"] == "priority"
            assert info["default_priority_value"] == 200
        with ThreadPoolExecutor(2) as pool:
            low = pool.submit(generate, cluster, "gen_low", 200, 7002, LOW_TOKENS)
            wait_until_decode_verified(cluster, "gen_low")
            high = pool.submit(generate, cluster, "gen_high", 250, 7001, HIGH_TOKENS)
            metas = {"gen_high": high.result(), "gen_low": low.result()}
        decode_log = cluster.logs["decode"].read_text(errors="replace")
        lines = engine_log_lines(cluster, "decode")
    for generation, meta in metas.items():
        assert meta["isolation_generation"] == generation
        assert meta["isolation_tenant"] == f"tenant-{generation}"
        assert meta["isolation_verified"] is True
        assert meta["completion_tokens"] == (LOW_TOKENS if generation == "gen_low" else HIGH_TOKENS)
        assert meta["finish_reason"]["type"] == "length"
    assert "Testing retraction" in decode_log  # SGLang retracted while both decoded
    reverified = [m[1] for line in lines if (m := re.search(r"reverified rid=(\S+)", line))]
    # Always the lower priority one (SGLang keeps at least one request, the higher one).
    assert reverified and set(reverified) == {"gen_low"}, lines[-20:]
    assert not refusals(lines, "foreign_page")
