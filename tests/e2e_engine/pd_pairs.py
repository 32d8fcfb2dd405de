"""Helpers for end-to-end tests of engine_patch on a real SGLang PD pair on the CPU.

Each test starts its own pair in its shape (the incident needs a prefill pool
below the context length) on ports 30100-30199, and stops it on every path.
Requests are sent the way the gateway sends them: the same body to prefill and
decode at once, with the bootstrap fields and the isolation headers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.dev.cluster import ClusterSpec, PDCluster, default_cluster_spec

PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT = 30110, 30111, 30112
CPU_SHIM_PLUGIN = "isogate_cpu"
ENGINE_PATCH_PLUGIN = "isogate"
INCIDENT_REPLAY_PLUGIN = "isogate_incident_replay"
ENGINE_LOG_PREFIX = "isogate-engine:"
# What the CPU shim logs in a server whose scheduler and detokenizer it forks
# (engine/cpu, isogate_engine_cpu.fork_workers).
FORKED_LOG_LINE = "isogate_cpu: scheduler and detokenizer forked, not spawned"
# Decode gives up on a prefill that never bootstraps, or on KV that never comes, after this long
# (default 300 s). Refused prompts end on this wait (prefill answers 400, decode 500 when it
# expires), so it is a test's duration; an honest transfer here takes well under a second, and
# the incident soak runs ordinary requests beside a 6 s wait.
SHORT_DISAGG_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "10",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10",
}


def plugin_env(*plugins: str) -> dict[str, str]:
    """SGLANG_PLUGINS whitelist: only these entry points load."""
    return {"SGLANG_PLUGINS": ",".join(plugins)}


def pair_spec(
    log_dir: Path,
    *,
    prefill_pool: int,
    decode_pool: int,
    context_length: int,
    env: Mapping[str, str],
    prefill_env: Mapping[str, str] | None = None,
) -> ClusterSpec:
    spec = default_cluster_spec(
        log_dir=log_dir,
        prefill_port=PREFILL_PORT,
        decode_port=DECODE_PORT,
        bootstrap_port=BOOTSTRAP_PORT,
        prefill_max_total_tokens=prefill_pool,
        decode_max_total_tokens=decode_pool,
        context_length=context_length,
    )
    return dataclasses.replace(
        spec,
        prefill=dataclasses.replace(spec.prefill, env={**env, **(prefill_env or {})}),
        decode=dataclasses.replace(spec.decode, env=dict(env)),
    )


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # parsed JSON, or the raw text when it is not JSON

    @property
    def content_text(self) -> str:
        return self.body.get("text", "") if isinstance(self.body, dict) else ""

    @property
    def meta_info(self) -> dict:
        return self.body.get("meta_info", {}) if isinstance(self.body, dict) else {}

    def is_200_with_content(self) -> bool:
        if self.status != 200:
            return False
        if isinstance(self.body, str):  # a stream: any chunk that carries tokens
            return any(
                isinstance(chunk, dict) and (chunk.get("text") or chunk.get("output_ids"))
                for chunk in stream_decode_chunks(self.body)
            )
        return bool(self.content_text or self.body.get("output_ids"))


@dataclass(frozen=True)
class PDReply:
    prefill: Reply
    decode: Reply


def _reply(response: httpx.Response) -> Reply:
    try:
        return Reply(response.status_code, response.json())
    except json.JSONDecodeError:
        return Reply(response.status_code, response.text)


def generate_pd(
    cluster: PDCluster,
    *,
    input_ids: list[int],
    generation: str,
    tenant: str,
    bootstrap_room: int,
    max_new_tokens: int = 8,
    timeout_s: float = 120.0,
    stream: bool = False,
) -> PDReply:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "rid": generation,
        "extra_key": f"salt-{tenant}",
        "stream": stream,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.bootstrap_port,
        "bootstrap_room": bootstrap_room,
    }
    headers = {"X-Isolation-Tenant": tenant, "X-Isolation-Generation": generation}
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(
            client.post, f"{cluster.prefill_url}/generate", json=body, headers=headers
        )
        decode = pool.submit(
            client.post, f"{cluster.decode_url}/generate", json=body, headers=headers
        )
        return PDReply(prefill=_reply(prefill.result()), decode=_reply(decode.result()))


def stream_decode_chunks(response_text: str) -> list[Any]:
    """The parsed `data:` events of an SSE body, [DONE] excluded."""
    chunks = []
    for line in response_text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def engine_log_lines(cluster: PDCluster, worker: str) -> list[str]:
    text = cluster.logs[worker].read_text(errors="replace")
    return [line for line in text.splitlines() if ENGINE_LOG_PREFIX in line]


def refusals(lines: list[str], reason: str) -> list[str]:
    return [line for line in lines if re.search(rf"refused reason={reason}\b", line)]


def incident_prompt(length: int) -> list[int]:
    # Any ids in the tiny model's vocabulary (512), avoiding the specials 0-2.
    return [3 + (i * 7) % 500 for i in range(length)]
