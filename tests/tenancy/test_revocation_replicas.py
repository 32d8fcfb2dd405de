"""A revocation or a tenant's disabling reaches every replica through Redis (issue 17,
finding 9): two gateway processes share one store and one Redis; the change is made on one,
and the other, which holds the key as valid in its cache (a TTL far longer than the test),
refuses it on its first request once the change is seen there."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.dev.harness import GatewayProcess
from tests.conftest import REDIS_URL
from tests.harness import PoolSpec, write_policies


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    from gateway.dev.model import ensure_tiny_model

    policies = write_policies(
        tmp_path / "policies",
        model_name="revocation-model",
        tokenizer_dir=ensure_tiny_model(),
        pools=[PoolSpec("shared", (("http://127.0.0.1:9", 1),), ("http://127.0.0.1:9",))],
    )
    env = {
        "ISOGATE_REDIS_URL": REDIS_URL,
        "ISOGATE_REDIS_KEY_PREFIX": "isogate-test-" + secrets.token_hex(6),
        "ISOGATE_AUTH_CACHE_TTL_S": "3600",  # only an invalidation can make a replica forget
    }
    first = GatewayProcess(policies_dir=policies, work_dir=tmp_path, env=env)
    first.start(wait_ready=False)  # no workers here: live, not ready
    try:
        # Made once the first listens: a free port picked before would be the first's.
        second = GatewayProcess(
            policies_dir=policies, work_dir=tmp_path, env=env, admin_key=first.admin_key
        )
        second.start(wait_ready=False)
        try:
            yield first, second
        finally:
            second.stop()
    finally:
        first.stop()


def _seen(replica: GatewayProcess, kind: str, count: int, timeout_s: float = 10.0) -> None:
    """Until the replica has applied ``count`` invalidations of ``kind`` (its metrics say so);
    returns either way: the assertion that follows is on behaviour."""
    pattern = re.compile(
        rf'^isogate_auth_invalidations_received_total\{{kind="{kind}"\}} (\S+)$', re.M
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with replica.admin() as admin:
            found = pattern.search(admin.get("/metrics").text)
        if found and float(found.group(1)) >= count:
            return
        time.sleep(0.05)


def _status(replica: GatewayProcess, key: str) -> int:
    return httpx.get(
        replica.url + "/v1/audit/events", headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).status_code


def test_a_key_revoked_on_one_replica_is_refused_by_the_other(
    replicas: tuple[GatewayProcess, GatewayProcess],
) -> None:
    first, second = replicas
    tenant_id, key = first.create_tenant()
    assert _status(second, key) == 200  # now in the second replica's cache, valid
    with first.admin() as admin:
        (record,) = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]
        admin.post(f"/admin/keys/{record['id']}/revoke").raise_for_status()
    _seen(second, "key", 1)
    assert _status(second, key) == 401
    assert _status(first, key) == 401


def test_a_tenant_disabled_on_one_replica_is_refused_by_the_other(
    replicas: tuple[GatewayProcess, GatewayProcess],
) -> None:
    first, second = replicas
    tenant_id, key = first.create_tenant()
    assert _status(second, key) == 200
    with first.admin() as admin:
        admin.post(f"/admin/tenants/{tenant_id}/disable").raise_for_status()
    _seen(second, "tenant", 1)
    assert _status(second, key) == 403
    with first.admin() as admin:
        admin.post(f"/admin/tenants/{tenant_id}/enable").raise_for_status()
    _seen(second, "tenant", 2)
    assert _status(second, key) == 200
