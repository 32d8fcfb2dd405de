"""Fixtures for the deployment tests: a gateway process in front of stand-in workers.

The stand-ins stand for SGLang here only because these tests are about the gateway's own
operations (metrics, logs, policy reload), not about what an engine does; ports come from
this suite's range (31200-31249) so parallel suites never collide.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.ports import worker_share
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "tiny-llama"
_GATEWAY_PORTS = itertools.cycle(worker_share(31200, 31220))
_WORKER_PORTS = itertools.cycle(worker_share(31220, 31248))


def port_from(ports: Iterator[int]) -> int:
    """The next port of this suite's range that is free now (the range lies inside Linux's
    ephemeral range, so an outgoing connection may hold one for a while)."""
    for _ in range(40):
        port = next(ports)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this suite's range")


@dataclass
class StandInPair:
    prefill: StandInWorker
    decode: StandInWorker
    bootstrap_port: int = 31249

    def pool(self, name: str = "shared") -> PoolSpec:
        return PoolSpec(name, ((self.prefill.url, self.bootstrap_port),), (self.decode.url,))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture
def standin_pair() -> Iterator[StandInPair]:
    prefill = StandInWorker("prefill", Behaviour(pool_tokens=2048), port=port_from(_WORKER_PORTS))
    decode = StandInWorker("decode", Behaviour(pool_tokens=4096), port=port_from(_WORKER_PORTS))
    with prefill, decode:
        yield StandInPair(prefill, decode)


@pytest.fixture
def start_gateway(
    tmp_path: Path, tiny_model_dir: Path, standin_pair: StandInPair
) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(**env: str) -> GatewayProcess:
        policies = write_policies(
            tmp_path / "policies",
            model_name=MODEL,
            tokenizer_dir=tiny_model_dir,
            pools=[standin_pair.pool()],
        )
        process = GatewayProcess(
            policies_dir=policies,
            work_dir=tmp_path / "work",
            port=port_from(_GATEWAY_PORTS),
            env=env,
        )
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.stop()


def log_lines(gateway: GatewayProcess, start: int = 0) -> list[dict[str, Any]]:
    """The gateway's JSON log lines from byte offset ``start`` on (every line must be JSON)."""
    data = gateway.log_path.read_bytes()[start:].decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def log_size(gateway: GatewayProcess) -> int:
    return gateway.log_path.stat().st_size


def wait_for(condition: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def model_ids(gateway: GatewayProcess, key: str) -> list[str]:
    response = httpx.get(
        gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    response.raise_for_status()
    return sorted(card["id"] for card in response.json()["data"])


def chat(
    gateway: GatewayProcess, key: str, content: str = "Say hello.", model: str = MODEL
) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
    )
