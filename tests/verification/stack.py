"""A real gateway process in front of stand-in workers that lie, for the fail-closed tests.

Only the SGLang workers are stand-ins, because real SGLang cannot be made to echo another
request's tags or miscount a prompt on cue. The decode stand-in's ``Behaviour`` is read at
request time, so one stack serves many lies. Ports come from this suite's range, 31100-31149.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.ports import worker_share
from tests.standin_worker import Behaviour, StandInWorker

MODEL = "tiny-llama"
POOL_TOKENS = 8192
_RANGE = worker_share(31100, 31150)
_PORTS = itertools.cycle(_RANGE)


def range_port() -> int:
    for _ in range(len(_RANGE)):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_RANGE}")


@dataclass
class LyingStack:
    prefill: StandInWorker
    decode: StandInWorker
    gateway: GatewayProcess

    def client(self, raw_key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway.url, headers={"Authorization": f"Bearer {raw_key}"}, timeout=30
        )

    def metric(self, name: str, **labels: str) -> float:
        return gateway_metric(self.gateway, name, **labels)


def gateway_metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples (from the gateway's /metrics) whose labels include
    ``labels``."""
    total = 0.0
    for line in httpx.get(
        gateway.url + "/metrics",
        timeout=10,
        headers={"Authorization": f"Bearer {gateway.admin_key}"},
    ).text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


@contextlib.contextmanager
def lying_stack(
    work_dir: Path,
    *,
    env: dict[str, str] | None = None,
    decode: Behaviour | None = None,
    tool_call_parser: str | None = None,
) -> Iterator[LyingStack]:
    model_dir = ensure_tiny_model(DEFAULT_MODEL_DIR)
    with contextlib.ExitStack() as stack:
        prefill_worker = stack.enter_context(
            StandInWorker("prefill", Behaviour(pool_tokens=POOL_TOKENS), port=range_port())
        )
        decode_worker = stack.enter_context(
            StandInWorker("decode", decode or Behaviour(pool_tokens=POOL_TOKENS), port=range_port())
        )
        policies = write_policies(
            work_dir / "policies",
            model_name=MODEL,
            tokenizer_dir=model_dir,
            pools=[PoolSpec("shared", ((prefill_worker.url, range_port()),), (decode_worker.url,))],
            max_context_tokens=POOL_TOKENS,
            require_engine_tags=True,
            tool_call_parser=tool_call_parser,
        )
        gateway = start_gateway(policies, work_dir, env or {})
        stack.callback(gateway.stop)
        yield LyingStack(prefill_worker, decode_worker, gateway)


def start_gateway(policies: Path, work_dir: Path, env: dict[str, str]) -> GatewayProcess:
    # Our range lies inside the kernel's ephemeral range: a port free when picked can be taken
    # by an outgoing connection before the gateway binds it. Pick another and retry.
    for attempt in range(3):
        gateway = GatewayProcess(
            policies_dir=policies, work_dir=work_dir, env=dict(env), port=range_port()
        )
        try:
            return gateway.start(timeout_s=20)
        except RuntimeError:
            gateway.stop()
            if "address already in use" not in gateway.log_tail() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def sse_events(response: httpx.Response) -> list[Any]:
    """The stream's ``data:`` payloads in order: parsed JSON, or the string ``[DONE]``."""
    return sse_payloads(response.iter_lines())


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """``sse_events`` of a stream's lines."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def streamed_content(events: list[Any]) -> str:
    text = ""
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text


def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
