"""What a tenant can see and read (issue 17, finding 8): pool names, never worker URLs; the
gateway's own error text, never the engine's; a store and spool readable by their owner only.

Stand-in workers: real SGLang does not refuse a request with a chosen message on purpose.
"""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.harness import GatewayProcess
from gateway.tenancy.audit import AuditSpool
from gateway.tenancy.store import audit_values
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "standin-model"
ENGINE_TEXT = "stand-in failure"  # what the stand-in's refusals say


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[StandInWorker, StandInWorker]]:
    with StandInWorker("prefill") as prefill, StandInWorker("decode") as decode:
        yield prefill, decode


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, workers: tuple[StandInWorker, StandInWorker]
) -> Iterator[GatewayProcess]:
    from gateway.dev.model import ensure_tiny_model

    prefill, decode = workers
    work = tmp_path_factory.mktemp("gateway")
    policies = write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=ensure_tiny_model(),
        pools=[PoolSpec("blue-pool", ((prefill.url, 1),), (decode.url,))],
    )
    with GatewayProcess(policies_dir=policies, work_dir=work) as process:
        yield process


def _chat(gateway: GatewayProcess, key: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_tenants_see_the_pool_and_admins_see_the_workers_too(
    gateway: GatewayProcess, workers: tuple[StandInWorker, StandInWorker]
) -> None:
    prefill, decode = workers
    _, key = gateway.create_tenant()
    response = _chat(gateway, key)
    assert response.status_code == 200
    generation_id = response.headers["X-Generation-Id"]
    path = f"/v1/audit/events/{generation_id}"
    tenant_view = httpx.get(gateway.url + path, headers={"Authorization": f"Bearer {key}"}).json()
    with gateway.admin() as admin:
        admin_view = admin.get(path).json()
    assert tenant_view["pool"] == admin_view["pool"] == "blue-pool"
    assert (admin_view["prefill_worker"], admin_view["decode_worker"]) == (prefill.url, decode.url)
    listed = httpx.get(
        gateway.url + "/v1/audit/events", headers={"Authorization": f"Bearer {key}"}
    ).text
    for answer in (str(tenant_view), listed):
        assert prefill.url not in answer and decode.url not in answer
        assert "127.0.0.1" not in answer


def _engine_errors_of(gateway: GatewayProcess, generation_id: str) -> list[dict[str, Any]]:
    """The gateway's log lines of this generation that carry an engine's error text."""
    found = []
    for line in gateway.log_path.read_text(errors="replace").splitlines():
        if generation_id in line and "engine_message" in line:
            found.append(json.loads(line))
    return found


# The engine's status -> what the client is told (gateway.workers.dispatch): a refusal is the
# client's request's fault, a failure the worker's, a 503 a worker unavailable.
ENGINE_REFUSALS = [
    (400, 400, "engine_rejected"),
    (500, 502, "upstream_error"),
    (503, 503, "worker_unavailable"),
]


@pytest.mark.parametrize(("engine_status", "status", "code"), ENGINE_REFUSALS)
def test_an_engine_refusal_reaches_the_client_in_the_gateways_words(
    gateway: GatewayProcess,
    workers: tuple[StandInWorker, StandInWorker],
    engine_status: int,
    status: int,
    code: str,
) -> None:
    prefill, _ = workers
    _, key = gateway.create_tenant()
    prefill.behaviour = Behaviour(status=engine_status)
    try:
        response = _chat(gateway, key)
    finally:
        prefill.behaviour = Behaviour()
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    assert ENGINE_TEXT not in response.text
    generation_id = response.headers["X-Generation-Id"]
    event = httpx.get(
        f"{gateway.url}/v1/audit/events/{generation_id}",
        headers={"Authorization": f"Bearer {key}"},
    ).text
    assert ENGINE_TEXT not in event
    # The operators' copy: this request's own log line, with the engine's words and status.
    deadline = time.monotonic() + 10
    while not (logged := _engine_errors_of(gateway, generation_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(line["status"], line["engine_message"]) for line in logged] == [
        (engine_status, ENGINE_TEXT)
    ], logged


def test_the_store_is_readable_by_its_owner_only(gateway: GatewayProcess) -> None:
    _chat(gateway, gateway.create_tenant()[1])  # something written
    database = gateway.work_dir / "isogate.db"
    assert stat.S_IMODE(database.stat().st_mode) == 0o600
    for sibling in database.parent.glob("isogate.db-*"):  # SQLite's WAL and shared memory
        assert stat.S_IMODE(sibling.stat().st_mode) == 0o600, sibling


def test_the_audit_spool_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    spool = AuditSpool(tmp_path / "spool")
    spool.open()
    try:
        spool.append([audit_values({"generation_id": "gen_1", "created_at": datetime.now(UTC)})])
        assert stat.S_IMODE(spool.directory.stat().st_mode) == 0o700
        (written,) = spool.files()
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
    finally:
        spool.close()
