"""The incident soak on real SGLang 0.5.23 CPU PD workers: each layer must hold on its own.

Both runs use the incident's shape (prefill pool 2048 < context length 8192 <= decode pool
8192) and the test-only plugin ``isogate_incident_replay`` with both SGLang fixes undone
(``ISOGATE_TEST_UNDO_ADMISSION_FIX=1``: admission and prefill retirement), so the engine
itself no longer stops an over-pool prompt.

- ``gateway_only``: engine_patch NOT loaded (``SGLANG_PLUGINS`` whitelist), requests through
  the gateway. The gateway alone must refuse every over-pool prompt and deliver nothing
  foreign. On the same pair, a short control run then bypasses the gateway: it MUST see the
  leak, which proves the soak can see one at all.
- ``engine_patch_only``: engine_patch loaded with its start-up gate off (it would refuse the
  shape outright; ``ISOGATE_ENGINE_DISABLE_CHECKS=gate``), requests sent straight to the
  workers the way a router does. engine_patch's per-request guard, coverage and page checks
  alone must stop every over-pool prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.dev.cluster import ClusterStartError, PDCluster, default_cluster_spec
from gateway.dev.harness import GatewayProcess, port_is_free
from tests.harness import PoolSpec, write_policies
from tests.reliability.incident_soak import (
    Soak,
    SoakShape,
    Tenant,
    bypass_sender,
    gateway_sender,
    make_tenants,
)
from tests.reliability.stack import range_port, wait_until
from tests.reliability.test_engine_faults import MIN_AVAILABLE_GIB, _available_gib

pytestmark = pytest.mark.engine

PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT = 30130, 30131, 30132
SHAPE = SoakShape()
TENANTS = ["acme", "globex", "initech", "umbrella"]
REQUESTS_PER_TENANT = int(os.environ.get("ISOGATE_SOAK_REQUESTS_PER_TENANT", "20"))
COMMON_ENV = {
    "ISOGATE_TEST_UNDO_ADMISSION_FIX": "1",  # both fixes undone: admission and retire
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "15",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "15",
}
LAYER_ENV = {
    "gateway_only": {"SGLANG_PLUGINS": "isogate_cpu,isogate_incident_replay"},
    # An over-pool prompt refused at prefill's tokenizer leaves decode holding its reservation
    # for KV that never comes, until SGLang's waiting timeout; decode's pool is small, so the
    # next requests queue behind it. A router drops decode on prefill's refusal; the bypass
    # sender waits for decode's own answer, so a shorter wait keeps the run bounded.
    "engine_patch_only": {
        "SGLANG_PLUGINS": "isogate_cpu,isogate_incident_replay,isogate",
        "ISOGATE_ENGINE_DISABLE_CHECKS": "gate",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "6",
    },
}


@contextlib.contextmanager
def incident_cluster(log_dir: Path, layer: str) -> Iterator[PDCluster]:
    """The pair, started; retried once when a port of ours was taken by someone's random port
    meanwhile (start-up takes minutes on this machine; the ports lie below the ephemeral range,
    but any program may bind them)."""
    for attempt in (1, 2):
        cluster = _incident_cluster(log_dir / f"attempt-{attempt}", layer)
        try:
            cluster.start()
        except ClusterStartError as error:
            if attempt == 2 or "address already in use" not in str(error):
                raise
            continue
        try:
            yield cluster
        finally:
            cluster.stop()
        return


def _incident_cluster(log_dir: Path, layer: str) -> PDCluster:
    spec = default_cluster_spec(
        log_dir=log_dir,
        prefill_port=PREFILL_PORT,
        decode_port=DECODE_PORT,
        bootstrap_port=BOOTSTRAP_PORT,
        prefill_max_total_tokens=SHAPE.prefill_pool,
        decode_max_total_tokens=SHAPE.decode_pool,
        context_length=SHAPE.context_length,
    )
    env = {**COMMON_ENV, **LAYER_ENV[layer]}
    return PDCluster(
        dataclasses.replace(
            spec,
            prefill=dataclasses.replace(spec.prefill, env=env),
            decode=dataclasses.replace(spec.decode, env=env),
        ),
        startup_timeout_s=600,
    )


@pytest.fixture
def memory_for_a_pair() -> None:
    if _available_gib() < MIN_AVAILABLE_GIB:
        pytest.fail(
            f"less than {MIN_AVAILABLE_GIB} GiB available: "
            "not starting a PD pair on the shared machine"
        )
    # A prefill that cannot bind its bootstrap port still answers /health_generate, and every
    # PD handshake then fails: wait for the previous pair's ports to be released first.
    assert wait_until(
        lambda: all(port_is_free(p) for p in (PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT)),
        timeout_s=60,
        interval_s=1,
    ), "the pair's ports are taken"


def _report(tmp_path: Path, name: str, counts: dict[str, object]) -> None:
    line = json.dumps({"run": name, **counts})
    print("SOAK", line)
    (tmp_path / f"soak-{name}.json").write_text(line)


def _assert_held(counts: dict[str, object]) -> None:
    by_kind = counts["by_kind"]
    assert (
        isinstance(by_kind, dict)
        and by_kind.get("over_pool", 0) > 0
        and by_kind.get("ordinary", 0) > 0
    )
    assert counts["foreign_canary_bytes"] == 0
    assert counts["over_pool_served"] == 0, (
        "an over-pool prompt was answered with content (stale pages)"
    )
    assert counts["over_pool_refused"] == by_kind["over_pool"]
    assert counts["served"] > 0


def test_gateway_alone_holds_the_incident_shape_and_the_bypass_control_leaks(
    tmp_path: Path, memory_for_a_pair: None
) -> None:
    with incident_cluster(tmp_path / "logs", "gateway_only") as cluster:
        policies = write_policies(
            tmp_path / "policies",
            model_name="tiny-llama",
            tokenizer_dir=cluster.spec.model_dir,
            pools=[
                PoolSpec(
                    "shared",
                    ((cluster.prefill_url, cluster.bootstrap_port),),
                    (cluster.decode_url,),
                )
            ],
            max_context_tokens=SHAPE.context_length,
            require_engine_tags=False,  # no engine_patch: no tags
            max_output_tokens=64,
        )
        with GatewayProcess(policies_dir=policies, work_dir=tmp_path, port=range_port()) as gateway:
            tenants = [
                Tenant(t.name, t.marker, gateway.create_tenant(t.name)[1])
                for t in make_tenants(TENANTS)
            ]
            soak = Soak(SHAPE, tenants, REQUESTS_PER_TENANT)
            counts = soak.run(gateway_sender(gateway.url)).to_json()
            _report(tmp_path, "gateway_on-engine_patch_off", counts)
        # Control: the same pair, the gateway bypassed, over-pool prompts only.
        control = Soak(SHAPE, make_tenants(TENANTS[:2]), 3, mix=(0.0, 1.0, 0.0))
        control_counts = control.run(
            bypass_sender(
                cluster.prefill_url,
                cluster.decode_url,
                cluster.bootstrap_port,
                cluster.spec.model_dir / "tokenizer.json",
            )
        ).to_json()
        _report(tmp_path, "control-no_layer", control_counts)
    _assert_held(counts)
    assert counts["verification_failures"] == 0
    assert control_counts["over_pool_served"] > 0, (
        "the control did not leak: the soak cannot see the incident"
    )


def test_engine_patch_alone_holds_the_incident_shape_with_the_gateway_bypassed(
    tmp_path: Path, memory_for_a_pair: None
) -> None:
    with incident_cluster(tmp_path / "logs", "engine_patch_only") as cluster:
        soak = Soak(SHAPE, make_tenants(TENANTS), REQUESTS_PER_TENANT)
        counts = soak.run(
            bypass_sender(
                cluster.prefill_url,
                cluster.decode_url,
                cluster.bootstrap_port,
                cluster.spec.model_dir / "tokenizer.json",
            )
        ).to_json()
        _report(tmp_path, "gateway_off-engine_patch_on", counts)
    _assert_held(counts)
