"""Two gateway processes sharing Redis decide on the same capacity observation of each worker."""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.dev.harness import GatewayProcess
from gateway.dev.model import ensure_tiny_model
from tests.harness import PoolSpec, write_policies
from tests.standin_worker import StandInWorker

REDIS_URL = "redis://127.0.0.1:6379/0"


def capacity_view(gateway: GatewayProcess) -> dict[str, dict[str, Any]]:
    with gateway.admin() as client:
        workers = client.get("/admin/workers").json()["data"]
    return {w["url"]: w["capacity"] for w in workers}


# A replica's capacity records, by worker URL and the wall-clock time of the poll behind each.
Observations = dict[tuple[str, float], dict[str, Any]]


def both_saw(first: Observations, second: Observations) -> set[tuple[str, float]]:
    """The observations both replicas reported: without a shared store each polls for itself,
    at its own instants, and there are none."""
    return first.keys() & second.keys()


def test_two_gateways_sharing_redis_see_the_same_capacity_numbers(tmp_path) -> None:
    prefill, decode = StandInWorker("prefill").start(), StandInWorker("decode").start()
    try:
        policies = write_policies(
            tmp_path / "policies",
            model_name="m",
            tokenizer_dir=ensure_tiny_model(),
            pools=[PoolSpec("shared", ((prefill.url, 1),), (decode.url,))],
        )
        one_store = {
            "ISOGATE_REDIS_URL": REDIS_URL,
            "ISOGATE_REDIS_KEY_PREFIX": "test-" + secrets.token_hex(4),
        }
        with (
            GatewayProcess(policies, tmp_path / "a", env=one_store) as first,
            GatewayProcess(policies, tmp_path / "b", env=one_store) as second,
        ):
            # Each replica's records by (worker, the poll that produced it). Read one after the
            # other, the two views can straddle a new poll (the more likely, the busier the
            # host), so what must agree is each observation both of them saw, not each moment.
            seen: tuple[Observations, Observations] = ({}, {})
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(both_saw(*seen)) < 6:
                for gateway, observations in zip((first, second), seen, strict=True):
                    for url, record in capacity_view(gateway).items():
                        if record:
                            observations[url, record["observed_at"]] = record
                time.sleep(0.3)
            common = both_saw(*seen)
            assert {url for url, _ in common} == {prefill.url, decode.url}, seen
            assert len(common) >= 6, seen
            assert all(seen[0][key] == seen[1][key] for key in common), seen
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
