"""engine_patch on real SGLang 0.5.23 PD workers on the CPU (marker `engine`).

Each test starts its own pair in the shape it needs (ports 30110-30112), one at a
time, and stops it. The incident shape: prefill pool (1024) below the context
length (4096), decode pool (4096) above it, a 2000-token prompt between them.

The incident replays load the test-only plugin `isogate_incident_replay`
(engine/testing), which undoes SGLang's admission fix (`is_unadmitted_reject`)
and prefill's retirement of a request with a pending abort; see its docstring.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from gateway.dev.cluster import STARTUP_TIMEOUT_S, PDCluster
from tests.e2e_engine.pd_pairs import (
    CPU_SHIM_PLUGIN,
    ENGINE_PATCH_PLUGIN,
    FORKED_LOG_LINE,
    INCIDENT_REPLAY_PLUGIN,
    SHORT_DISAGG_TIMEOUTS,
    PDReply,
    engine_log_lines,
    generate_pd,
    incident_prompt,
    pair_spec,
    plugin_env,
    refusals,
    stream_decode_chunks,
)

pytestmark = pytest.mark.engine

PREFILL_POOL, DECODE_POOL, CONTEXT = 1024, 4096, 4096
PROMPT_BETWEEN_POOLS = 2000
UNDO_FIXES = {"ISOGATE_TEST_UNDO_ADMISSION_FIX": "1"}


def incident_pair(
    tmp_path: Path, plugins: list[str], *, fork_workers: bool = True, **env: str
) -> PDCluster:
    spec = pair_spec(
        tmp_path / "logs",
        prefill_pool=PREFILL_POOL,
        decode_pool=DECODE_POOL,
        context_length=CONTEXT,
        env={**plugin_env(*plugins), **SHORT_DISAGG_TIMEOUTS, **env},
    )
    return PDCluster(dataclasses.replace(spec, fork_workers=fork_workers))


def replay(cluster: PDCluster) -> tuple[PDReply, PDReply]:
    """Tenant A fills decode pages with its prompt, then tenant B sends the over-pool prompt."""
    earlier = generate_pd(
        cluster,
        input_ids=incident_prompt(900)[::-1],
        generation="gen_A1",
        tenant="tenant-a",
        bootstrap_room=1001,
        max_new_tokens=4,
    )
    incident = generate_pd(
        cluster,
        input_ids=incident_prompt(PROMPT_BETWEEN_POOLS),
        generation="gen_B1",
        tenant="tenant-b",
        bootstrap_room=1002,
        max_new_tokens=8,
        timeout_s=120,
    )
    print(
        "incident replay:",
        json.dumps(
            {
                "prefill": [incident.prefill.status, incident.prefill.body],
                "decode": [incident.decode.status, incident.decode.body],
            }
        )[:3000],
    )
    return earlier, incident


def test_without_engine_patch_the_incident_replays_on_0_5_23(tmp_path):
    # Recorded on 0.5.23 with both fixes undone: prefill handles the one-token
    # stub and signals completion, decode reads 2000 positions of which prefill
    # wrote one and answers 200 with content.
    with incident_pair(
        tmp_path, [CPU_SHIM_PLUGIN, INCIDENT_REPLAY_PLUGIN], **UNDO_FIXES
    ) as cluster:
        earlier, incident = replay(cluster)
    assert earlier.decode.is_200_with_content()
    assert incident.prefill.meta_info.get("prompt_tokens") == 1  # the stub is what prefill computed
    assert incident.decode.is_200_with_content()  # the leak: HTTP 200 and text
    assert incident.decode.meta_info.get("prompt_tokens") == PROMPT_BETWEEN_POOLS
    assert "isolation_tenant" not in incident.decode.meta_info  # no plugin, no echo


def test_without_engine_patch_undoing_only_the_admission_fix_does_not_leak_on_0_5_23(tmp_path):
    # Recorded on 0.5.23: with is_unadmitted_reject undone but prefill's retirement
    # of a pending abort intact, prefill answers the stub with 400 and aborts its
    # sender; decode waits for KV that never comes and fails with 500 (transfer
    # timeout). The later cleanup closes the leak on its own on this version.
    with incident_pair(
        tmp_path,
        [CPU_SHIM_PLUGIN, INCIDENT_REPLAY_PLUGIN],
        ISOGATE_TEST_UNDO_FIXES="admission",
        **UNDO_FIXES,
    ) as cluster:
        _, incident = replay(cluster)
    assert incident.prefill.status == 400
    assert incident.decode.status == 500
    assert not incident.decode.is_200_with_content()


def test_with_engine_patch_the_incident_worker_refuses_to_start(tmp_path):
    # Prefill alone: its pool is the one below the context length (decode's holds it), and a
    # decode starting beside it would only slow it down.
    plugins = [CPU_SHIM_PLUGIN, INCIDENT_REPLAY_PLUGIN, ENGINE_PATCH_PLUGIN]
    prefill = incident_pair(tmp_path, plugins, **UNDO_FIXES).prefill
    prefill.start()
    try:
        exit_code = prefill.wait(timeout_s=STARTUP_TIMEOUT_S)
    finally:
        prefill.stop()
    prefill_log = prefill.log_path.read_text(errors="replace")
    assert "refusing to start: the KV pool holds" in prefill_log
    assert f"fewer than the context length {CONTEXT}" in prefill_log
    assert exit_code is not None and exit_code != 0, prefill_log[-2000:]


def test_with_engine_patch_clamped_tags_come_back_and_the_over_pool_prompt_gets_400(tmp_path):
    plugins = [CPU_SHIM_PLUGIN, INCIDENT_REPLAY_PLUGIN, ENGINE_PATCH_PLUGIN]
    # SGLang's own spawn, as on a GPU: each child loads the plugin itself, where the other
    # pairs' forked children inherit it. This pair's checks run in all three processes.
    with incident_pair(
        tmp_path, plugins, fork_workers=False, ISOGATE_ENGINE_CLAMP_CONTEXT="1", **UNDO_FIXES
    ) as cluster:
        with httpx.Client(timeout=30) as client:
            models = client.get(f"{cluster.prefill_url}/v1/models").json()
            server_info = client.get(f"{cluster.prefill_url}/server_info").json()
        normal = generate_pd(
            cluster,
            input_ids=incident_prompt(300),
            generation="gen_T1",
            tenant="tenant-t",
            bootstrap_room=2001,
        )
        streamed = generate_pd(
            cluster,
            input_ids=incident_prompt(200),
            generation="gen_T2",
            tenant="tenant-t",
            bootstrap_room=2002,
            stream=True,
        )
        _, incident = replay(cluster)
        decode_lines = engine_log_lines(cluster, "decode")
        prefill_lines = engine_log_lines(cluster, "prefill")
        server_logs = [log.read_text(errors="replace") for log in cluster.logs.values()]

    assert not any(FORKED_LOG_LINE in log for log in server_logs)  # spawned, as asked
    clamped = models["data"][0]["max_model_len"]
    assert clamped <= PREFILL_POOL < CONTEXT
    assert server_info["context_length"] == clamped

    # Tags come back from decode, verified.
    assert normal.decode.status == 200
    assert normal.decode.meta_info["isolation_tenant"] == "tenant-t"
    assert normal.decode.meta_info["isolation_generation"] == "gen_T1"
    assert normal.decode.meta_info["isolation_verified"] is True
    chunks = stream_decode_chunks(
        streamed.decode.body if isinstance(streamed.decode.body, str) else ""
    )
    assert len(chunks) >= 2
    for chunk in (chunks[0], chunks[-1]):
        assert chunk["meta_info"]["isolation_tenant"] == "tenant-t"
        assert chunk["meta_info"]["isolation_generation"] == "gen_T2"
    assert any("verified rid=gen_T1" in line for line in decode_lines)

    # The over-pool prompt: 400 at prefill's tokenizer, never content from decode.
    assert incident.prefill.status == 400
    assert "does not fit this worker's KV pool" in json.dumps(incident.prefill.body)
    assert refusals(prefill_lines, "over_pool")
    assert not incident.decode.is_200_with_content()


@pytest.mark.parametrize(
    ("disabled", "reason"),
    [
        ("gate,guard", "coverage_mismatch"),  # the coverage check on its own
        ("gate,guard,coverage", "foreign_page"),  # the page tags on their own
    ],
)
def test_with_engine_patch_an_admitted_incident_fails_with_500_and_is_logged(
    tmp_path, disabled, reason
):
    plugins = [CPU_SHIM_PLUGIN, INCIDENT_REPLAY_PLUGIN, ENGINE_PATCH_PLUGIN]
    with incident_pair(
        tmp_path, plugins, ISOGATE_ENGINE_DISABLE_CHECKS=disabled, **UNDO_FIXES
    ) as cluster:
        earlier, incident = replay(cluster)
        streamed = generate_pd(
            cluster,
            input_ids=[*incident_prompt(PROMPT_BETWEEN_POOLS)[1:], 7],
            generation="gen_B2",
            tenant="tenant-b",
            bootstrap_room=1003,
            stream=True,
            timeout_s=120,
        )
        decode_lines = engine_log_lines(cluster, "decode")
    assert (
        earlier.decode.status == 200 and earlier.decode.meta_info["isolation_tenant"] == "tenant-a"
    )
    assert incident.decode.status == 500
    assert not incident.decode.is_200_with_content()
    assert reason in incident.decode.body["message"]
    assert len(refusals(decode_lines, reason)) == 2

    # Streaming: SGLang has sent the 200 status line, so the failure is the one
    # event of the stream, an abort carrying 500 and the reason, with no tokens.
    print("streamed incident:", streamed.decode.status, str(streamed.decode.body)[:1500])
    assert not streamed.decode.is_200_with_content()
    events = stream_decode_chunks(streamed.decode.body)
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500
    assert reason in finish["message"]
