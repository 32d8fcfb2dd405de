"""A real gateway process in front of stand-in workers: the fast stack for input, auth and fault
tests.

The gateway runs exactly as deployed (``isogate serve`` in its own process, real HTTP, real
SQLite or PostgreSQL, real Redis when given); only the SGLang workers are stand-ins, because
these tests need workers that hang, or that a test can make disappear, on cue.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.dev.harness import GatewayProcess, port_is_free
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.ports import worker_share
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "tiny-llama"
# Stand-in decode pools hold this many tokens (what /server_info and /v1/loads report).
STANDIN_POOL_TOKENS = 8192
# Limits no test here means to reach (the harness's defaults for every other tenant).
UNLIMITED = {"requests_per_minute": 100000, "tokens_per_minute": 100000000, "max_concurrent": 1000}
# This suite's port range for stand-ins and gateways (31300-31399); the real SGLang pairs use 301xx.
# Each xdist worker has its own share of it, and each test process starts at its own offset in
# it, so two runs of these suites at once rarely collide.
_RANGE = worker_share(31300, 31400)
_FIRST = random.randrange(len(_RANGE))
_PORTS = itertools.cycle([*_RANGE[_FIRST:], *_RANGE[:_FIRST]])


def range_port() -> int:
    """A free port from this suite's range, so parallel suites never collide."""
    for _ in range(len(_RANGE)):
        port = next(_PORTS)
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {_RANGE}")


@dataclass
class StandInStack:
    """Stand-in prefill + decode workers, policies for them, and a gateway process in front."""

    prefill: StandInWorker
    decode: StandInWorker
    gateway: GatewayProcess
    tenants: dict[str, str] = field(default_factory=dict)  # tenant id → raw key

    def key(self, tenant_id: str) -> str:
        if tenant_id not in self.tenants:
            self.tenants[tenant_id] = self.gateway.create_tenant(tenant_id)[1]
        return self.tenants[tenant_id]

    def client(self, raw_key: str | None, timeout_s: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {raw_key}"} if raw_key else {}
        return httpx.Client(base_url=self.gateway.url, headers=headers, timeout=timeout_s)


def chat_body(text: str = "Say hello.", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }


@contextlib.contextmanager
def standin_stack(
    work_dir: Path,
    *,
    behaviour: Behaviour | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    max_output_tokens: int = 1024,
    default_limits: dict[str, int] | None = None,
    worker_keep_alive_s: int = 5,
    tenants: dict[str, Any] | None = None,
) -> Iterator[StandInStack]:
    """Start the stack; stop every part of it on the way out, whatever happened."""
    model_dir = ensure_tiny_model(DEFAULT_MODEL_DIR)
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(
            StandInWorker(
                "prefill",
                Behaviour(pool_tokens=STANDIN_POOL_TOKENS),
                port=range_port(),
                keep_alive_s=worker_keep_alive_s,
            )
        )
        decode = stack.enter_context(
            StandInWorker(
                "decode",
                behaviour or Behaviour(pool_tokens=STANDIN_POOL_TOKENS),
                port=range_port(),
                keep_alive_s=worker_keep_alive_s,
            )
        )
        policies = write_policies(
            work_dir / "policies",
            model_name=MODEL,
            tokenizer_dir=model_dir,
            pools=[PoolSpec("shared", ((prefill.url, 31490),), (decode.url,))],
            max_context_tokens=STANDIN_POOL_TOKENS,
            max_output_tokens=max_output_tokens,
            default_limits=default_limits,
            tenants=tenants,
        )
        gateway = GatewayProcess(
            policies_dir=policies, work_dir=work_dir, env=dict(env or {}), port=port or range_port()
        )
        stack.enter_context(gateway)
        yield StandInStack(prefill, decode, gateway)


def process_status(pid: int) -> dict[str, int]:
    """VmRSS (kB), open file descriptors and threads of a process, from /proc."""
    status: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "Threads"):
            status[name] = int(value.split()[0])
    status["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return status


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@dataclass
class TwoPoolStack:
    """A victim tenant on its own dedicated pool, every other tenant on a shared pool.

    A fault injected into the victim's pool must stay there: the shared pool's tenants keep
    being served while it lasts. Workers are stand-ins unless a test passes real URLs.
    """

    gateway: GatewayProcess
    victim: str
    victim_prefill: Any
    victim_decode: Any
    shared_prefill: Any
    shared_decode: Any
    tenants: dict[str, str] = field(default_factory=dict)

    def key(self, tenant_id: str) -> str:
        if tenant_id not in self.tenants:
            self.tenants[tenant_id] = self.gateway.create_tenant(tenant_id)[1]
        return self.tenants[tenant_id]

    def client(self, tenant_id: str, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway.url,
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {self.key(tenant_id)}"},
        )

    def audit_events(self, tenant_id: str) -> list[dict[str, Any]]:
        """Every audit event of a tenant, all pages."""
        events: list[dict[str, Any]] = []
        cursor: str | None = None
        with self.gateway.admin() as admin:
            while True:
                params = {
                    "tenant": tenant_id,
                    "limit": "1000",
                    **({"cursor": cursor} if cursor else {}),
                }
                page = admin.get("/v1/audit/events", params=params)
                for _ in range(
                    5
                ):  # by design a read on a connection the database dropped fails once (503)
                    if page.status_code != 503:
                        break
                    time.sleep(0.2)
                    page = admin.get("/v1/audit/events", params=params)
                page.raise_for_status()
                events += page.json()["data"]
                cursor = page.json()["next_cursor"]
                if not cursor:
                    return events


@dataclass(frozen=True)
class PoolWorkers:
    prefill_url: str
    bootstrap_port: int
    decode_url: str


def two_pool_policies(
    work_dir: Path,
    *,
    victim: str,
    victim_pool: PoolWorkers,
    shared_pool: PoolWorkers,
    tokenizer_dir: Path | None = None,
    max_context_tokens: int = STANDIN_POOL_TOKENS,
    require_engine_tags: bool = True,
) -> Path:
    return write_policies(
        work_dir / "policies",
        model_name=MODEL,
        tokenizer_dir=tokenizer_dir or ensure_tiny_model(DEFAULT_MODEL_DIR),
        pools=[
            PoolSpec(
                "victim",
                ((victim_pool.prefill_url, victim_pool.bootstrap_port),),
                (victim_pool.decode_url,),
                dedicated_to=(victim,),
            ),
            PoolSpec(
                "shared",
                ((shared_pool.prefill_url, shared_pool.bootstrap_port),),
                (shared_pool.decode_url,),
            ),
        ],
        max_context_tokens=max_context_tokens,
        require_engine_tags=require_engine_tags,
        # A tenant entry does not inherit the file's default limits: give the victim the same large
        # ones.
        tenants={victim: {"isolation": "dedicated", "limits": dict(UNLIMITED)}},
    )
