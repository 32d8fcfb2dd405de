"""Two gateway processes sharing Redis decide on the same capacity observation of each worker."""

from __future__ import annotations

import secrets
import time

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import StandInWorker

REDIS_URL = "redis://127.0.0.1:6379/0"


def capacity_view(gateway: GatewayProcess) -> dict[str, dict]:
    with gateway.admin() as client:
        workers = client.get("/admin/workers").json()["data"]
    return {w["url"]: w["capacity"] for w in workers}


def test_two_gateways_sharing_redis_see_the_same_capacity_numbers(tmp_path) -> None:
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    try:
        policies = write_policies(
            tmp_path / "policies",
            model_name="m",
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
        )
        shared = {
            "ISOGATE_REDIS_URL": REDIS_URL,
            "ISOGATE_REDIS_KEY_PREFIX": "test-" + secrets.token_hex(4),
        }
        with (
            GatewayProcess(policies, tmp_path / "a", env=shared) as first,
            GatewayProcess(policies, tmp_path / "b", env=shared) as second,
        ):
            matches = 0
            deadline = time.monotonic() + 20
            while matches < 3 and time.monotonic() < deadline:
                a, b = capacity_view(first), capacity_view(second)
                if a == b and all(a.values()):
                    matches += 1
                time.sleep(0.3)
            assert matches >= 3, (a, b)
            # One replica polls per interval: the workers see about one poll per interval, not two.
            polls_before, started = decode.polls, time.monotonic()
            time.sleep(3)
            rate = (decode.polls - polls_before) / (time.monotonic() - started)
            assert rate < 1.5 / 0.5, (
                rate
            )  # poll interval 0.5 s in the harness; two pollers would be ~4/s
    finally:
        prefill.stop()
        decode.stop()


def test_without_redis_each_gateway_polls_for_itself(tmp_path) -> None:
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    try:
        policies = write_policies(
            tmp_path / "policies",
            model_name="m",
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
        )
        with GatewayProcess(policies, tmp_path / "a"), GatewayProcess(policies, tmp_path / "b"):
            polls_before, started = decode.polls, time.monotonic()
            time.sleep(3)
            rate = (decode.polls - polls_before) / (time.monotonic() - started)
            assert rate > 1.5 / 0.5, rate
    finally:
        prefill.stop()
        decode.stop()
