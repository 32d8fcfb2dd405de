"""A PostgreSQL outage under load, seen through a real gateway process.

The gateway (``isogate serve``, its own process) reaches the real PostgreSQL through a
``SeverableProxy``; the network path is cut while a client keeps sending requests, until the
gateway has spooled audit events and served keys from its cache past their lifetime (and at
least ``ISOGATE_TEST_OUTAGE_S``, for a longer outage by hand), then restored until the spool
is replayed, then the gateway is stopped gracefully. Every request the client made must then
be in the audit log exactly once, with what the client saw.

No SGLang workers are needed: each request names a model the policies do not have (a
distinct name per request), which the gateway refuses after authenticating it, and audits.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from gateway.dev.harness import GatewayProcess, free_port
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.tenancy.store import Store, audit_events, create_store
from tests.harness import PoolSpec, write_policies

from .conftest import PostgresSchema
from .severable_proxy import SeverableProxy

OUTAGE_S = float(os.environ.get("ISOGATE_TEST_OUTAGE_S", "0"))
# Each wait below is for an event; this is only how long a missing one is awaited.
PATIENCE_S = 60.0


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def audited(store: Store, tenant_id: str) -> int:
    with store.engine.connect() as conn:
        return conn.execute(
            select(func.count()).where(audit_events.c.tenant_id == tenant_id)
        ).scalar_one()


class SteadyClient(threading.Thread):
    """Sends one request after another until stopped; remembers what it sent and got."""

    def __init__(self, base_url: str, key: str):
        super().__init__(daemon=True)
        self.client = httpx.Client(
            base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=30
        )
        self.sent: list[tuple[str, int, str | None]] = []  # (model, status, error code)
        self.stopping = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stopping.is_set():
            model = f"no-such-model-{i:06d}"
            response = self.client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            )
            code = (
                response.json().get("error", {}).get("code")
                if response.status_code != 200
                else None
            )
            self.sent.append((model, response.status_code, code))
            i += 1
            time.sleep(0.01)
        self.client.close()


@pytest.mark.postgres
def test_postgres_outage_under_load_loses_no_audit_event(tmp_path: Path) -> None:
    schema = PostgresSchema()
    schema.create()
    direct_url = schema.url()
    url = make_url(direct_url)
    proxy = SeverableProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.restore()
    via_proxy = url.set(port=proxy.port).render_as_string(hide_password=False)
    dead = free_port()
    policies = write_policies(
        tmp_path / "policies",
        model_name="tiny-llama",
        tokenizer_dir=ensure_tiny_model(DEFAULT_MODEL_DIR),
        pools=[
            PoolSpec("shared", ((f"http://127.0.0.1:{dead}", dead),), (f"http://127.0.0.1:{dead}",))
        ],
    )
    gateway = GatewayProcess(
        policies, tmp_path / "gateway", env={"ISOGATE_DATABASE_URL": via_proxy}
    )
    client = None
    direct = create_store(direct_url)
    try:
        gateway.start(wait_ready=False)
        tenant_id, key = gateway.create_tenant()
        client = SteadyClient(gateway.url, key)
        client.start()
        # Before the outage, the client's requests are audited in the database.
        wait_for(lambda: audited(direct, tenant_id) >= 10, "events in the database")
        proxy.sever()
        severed_at = time.monotonic()
        sent_before_outage = len(client.sent)
        # The outage lasts until the gateway has met it on both sides: events spooled, and a
        # key looked up past its cache lifetime and served from the cache; and the client has
        # kept it busy meanwhile.
        wait_for(
            lambda: (
                "spooling" in gateway.log_tail(1_000_000)
                and "key store unreachable" in gateway.log_tail(1_000_000)
                and len(client.sent) - sent_before_outage > 50
                and time.monotonic() - severed_at >= OUTAGE_S
            ),
            "the outage seen by the audit log and by authentication",
            timeout_s=PATIENCE_S + OUTAGE_S,
        )
        sent_during_outage = len(client.sent) - sent_before_outage
        proxy.restore()
        sent_before_restore = len(client.sent)
        wait_for(
            lambda: (
                "spool replayed" in gateway.log_tail(1_000_000)
                and len(client.sent) > sent_before_restore + 10
            ),
            "the spool replayed, with requests after the restore",
        )
        client.stopping.set()
        client.join(timeout=30)
        gateway.stop()  # graceful: the audit log is flushed before the process exits
    finally:
        if client is not None:
            client.stopping.set()
        gateway.stop()
        proxy.sever()
        direct.dispose()

    store = create_store(direct_url)
    try:
        with store.engine.connect() as conn:
            rows = conn.execute(
                select(
                    audit_events.c.model,
                    audit_events.c.status,
                    audit_events.c.code,
                    audit_events.c.outcome,
                )
                .where(audit_events.c.tenant_id == tenant_id)
                .order_by(audit_events.c.seq)
            ).all()
    finally:
        store.dispose()
        schema.drop()

    assert sent_during_outage > 50, "the client must have kept the gateway busy during the outage"
    # The gateway kept serving (authenticating from its cache) through the outage.
    assert {status for _, status, _ in client.sent} == {404}, Counter(s for _, s, _ in client.sent)
    assert len(rows) == len(client.sent)
    assert [(r.model, r.status, r.code) for r in rows] == client.sent  # content and order
    assert {r.outcome for r in rows} == {"rejected"}
    # ...and the events of the outage really went through the spool.
    log = gateway.log_path.read_text()
    assert "spooling" in log and "spool replayed" in log, gateway.log_tail()
