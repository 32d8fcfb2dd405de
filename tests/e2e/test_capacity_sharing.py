"""Two gateway processes sharing Redis decide on the same capacity observation of each worker;
without it, each decides on its own polls.

The stand-in answers every capacity poll with another count of used tokens, so two records
are one observation exactly when they come from one poll. What is compared is observations,
never a rate: how often the workers are polled is a matter of time, for ``make bench``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
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


def of_worker(worker: StandInWorker, observations: Observations) -> list[dict[str, Any]]:
    return [record for (url, _), record in observations.items() if url == worker.url]


def collect(
    first: GatewayProcess,
    second: GatewayProcess,
    enough: Callable[[Observations, Observations], bool],
    timeout_s: float = 20.0,
) -> tuple[Observations, Observations]:
    """Each replica's records, read one after the other until ``enough`` of them (or the
    deadline). Two reads can straddle a new poll (the more likely, the busier the host), so
    what is compared is each observation, not each moment."""
    seen: tuple[Observations, Observations] = ({}, {})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not enough(*seen):
        for gateway, observations in zip((first, second), seen, strict=True):
            for url, record in capacity_view(gateway).items():
                if record:
                    observations[url, record["observed_at"]] = record
        time.sleep(0.3)
    return seen


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
            seen = collect(first, second, lambda *seen: len(both_saw(*seen)) >= 6)
            common = both_saw(*seen)
            assert {url for url, _ in common} == {prefill.url, decode.url}, seen
            assert len(common) >= 6, seen
            assert all(seen[0][key] == seen[1][key] for key in common), seen
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
        with (
            GatewayProcess(policies, tmp_path / "a") as first,
            GatewayProcess(policies, tmp_path / "b") as second,
        ):
            seen = collect(
                first,
                second,
                lambda *seen: all(len(of_worker(decode, view)) >= 3 for view in seen),
            )
            assert all(len(of_worker(decode, view)) >= 3 for view in seen), seen
            # Each replica's records are of its own polls: none is one of the other's.
            assert not both_saw(*seen), seen
            used = [{record["used_tokens"] for record in of_worker(decode, view)} for view in seen]
            assert not used[0] & used[1], used
    finally:
        prefill.stop()
        decode.stop()
