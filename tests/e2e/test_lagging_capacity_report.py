"""A worker's reported use lags the end of the requests it counted: a request the pool has
room for is served, not refused on a poll taken while the one before it still ran.

A stand-in decode is used because real SGLang's reports lag by chance (a poll that lands
during a request), not on purpose; here every poll during a generation, and the first one
after, reports the whole pool in use.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "standin-model"
POLL_INTERVAL_S = 0.2


def _chat(gateway: GatewayProcess, key: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _decode_use_seen(gateway: GatewayProcess, decode: StandInWorker) -> int | None:
    with gateway.admin() as client:
        workers = client.get("/admin/workers").json()["data"]
    capacity = next(w["capacity"] for w in workers if w["url"] == decode.url)
    return capacity.get("used_tokens") if capacity else None


def test_a_request_right_after_another_is_served_though_the_last_poll_saw_the_pool_full(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    behaviour = Behaviour(full_pool_polls_after=1, gate=gate)
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode", behaviour).start()
    try:
        policies = write_policies(
            tmp_path / "policies",
            model_name=MODEL,
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
        )
        env = {"ISOGATE_CAPACITY_POLL_INTERVAL_S": str(POLL_INTERVAL_S)}
        with GatewayProcess(policies, tmp_path / "gw", env=env) as gateway:
            _, key = gateway.create_tenant()
            first: list[httpx.Response] = []
            runs = threading.Thread(target=lambda: first.append(_chat(gateway, key)))
            runs.start()
            # Held at decode until the gateway has seen the pool reported full.
            deadline = time.monotonic() + 20
            while _decode_use_seen(gateway, decode) != behaviour.pool_tokens:
                assert time.monotonic() < deadline, "the gateway never saw the full report"
                time.sleep(0.05)
            gate.set()
            runs.join(timeout=30)
            assert first and first[0].status_code == 200, first
            # At once: the gateway's newest observation of decode is still the full pool.
            second = _chat(gateway, key)
            assert second.status_code == 200, second.text
    finally:
        prefill.stop()
        decode.stop()
