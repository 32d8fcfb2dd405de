"""Gateway processes in front of honest stand-in workers, with the platform team's policies
written per test: two models on one pool, tenants with fixed ids (so tenants.yaml can name
them), and, with ``replicas=2``, two gateways sharing one store and one Redis.

Only the workers are stand-ins: model access, aliases, limits and budgets are the gateway's
own, and none needs a real engine's output.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.conftest import REDIS_URL
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "tiny-llama"
OTHER_MODEL = "other-model"

# Edits the two documents (models.yaml, tenants.yaml) in place before they are written.
PolicyEdit = Callable[[dict[str, Any], dict[str, Any]], None]


@dataclass
class PolicyStack:
    gateways: list[GatewayProcess]
    policies: Path
    prefill: StandInWorker
    decode: StandInWorker

    @property
    def gateway(self) -> GatewayProcess:
        return self.gateways[0]

    def key(self, tenant_id: str) -> str:
        """A new key of the tenant (created on first use)."""
        with self.gateway.admin() as admin:
            if admin.get(f"/admin/tenants/{tenant_id}").status_code == 404:
                admin.post("/admin/tenants", json={"id": tenant_id}).raise_for_status()
            created = admin.post(f"/admin/tenants/{tenant_id}/keys", json={})
            created.raise_for_status()
            key: str = created.json()["key"]
            return key

    def client(self, key: str, replica: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateways[replica].url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )

    def audit(self, **params: str) -> list[dict[str, Any]]:
        """Events as the admin reads them (``detail`` whole)."""
        with self.gateway.admin() as admin:
            data: list[dict[str, Any]] = admin.get("/v1/audit/events", params=params).json()["data"]
            return data


def chat(model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


@contextlib.contextmanager
def policy_stack(
    work_dir: Path,
    edit: PolicyEdit | None = None,
    *,
    replicas: int = 1,
    redis: bool = True,
    env: dict[str, str] | None = None,
) -> Iterator[PolicyStack]:
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(StandInWorker("prefill", Behaviour()))
        decode = stack.enter_context(StandInWorker("decode", Behaviour()))
        policies = write_policies(
            work_dir / "policies",
            model_name=MODEL,
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
            max_context_tokens=8192,
            plain_twin=OTHER_MODEL,
        )
        if edit is not None:
            models = yaml.safe_load((policies / "models.yaml").read_text())
            tenants = yaml.safe_load((policies / "tenants.yaml").read_text())
            edit(models, tenants)
            (policies / "models.yaml").write_text(yaml.safe_dump(models))
            (policies / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        shared_env = dict(env or {})
        if redis:
            shared_env["ISOGATE_REDIS_URL"] = REDIS_URL
            shared_env["ISOGATE_REDIS_KEY_PREFIX"] = "isogate-test-" + secrets.token_hex(6)
        gateways: list[GatewayProcess] = []
        for _ in range(replicas):
            gateway = GatewayProcess(
                policies_dir=policies,
                work_dir=work_dir,
                env=shared_env,
                admin_key=gateways[0].admin_key if gateways else "admin-" + secrets.token_hex(16),
            )
            stack.callback(gateway.stop)
            gateways.append(gateway.start(timeout_s=30))
        yield PolicyStack(gateways, policies, prefill, decode)
