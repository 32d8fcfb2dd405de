"""The incident soak on real SGLang 0.5.23 CPU PD workers: each layer must hold on its own.

Both runs use the incident's shape on the DeepSeek-V4 dev model: in `make test` a small one
(prefill pool 2048 < context length 8192 <= decode pool 8192); with ``ISOGATE_SOAK_SHAPE=real``
(``scripts/soak incident-real``) the incident's own numbers on DeepSeek-V4's tokenizer
(prefill pool 681,280 < context length 1,048,576 < decode pool 1,049,600). Both use the
test-only plugin ``isogate_incident_replay`` with both SGLang fixes undone
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

Every run ends with the differential rounds (``incident_soak``): in the control the probe's
greedy output must change with the other tenants' traffic (foreign data reached it); with a
layer on, the probe is refused every round. The honest probe never changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.dev.cluster import ClusterStartError, PDCluster, default_cluster_spec, group_members
from gateway.dev.harness import GatewayProcess, port_is_free
from tests.harness import PoolSpec, write_policies
from tests.reliability.incident_soak import (
    REAL_SHAPE,
    Soak,
    SoakShape,
    Tenant,
    bypass_sender,
    gateway_sender,
    make_tenants,
)
from tests.reliability.stack import range_port, wait_until
from tests.reliability.test_engine_faults import MIN_AVAILABLE_GIB, _available_gib

AT_SCALE = os.environ.get("ISOGATE_SOAK_SHAPE") == "real"
# At scale one run tokenizes and sends dozens of prompts of up to a million tokens.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600 if AT_SCALE else 600)]

PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT = 30130, 30131, 30132
SHAPE = REAL_SHAPE if AT_SCALE else SoakShape()
TENANTS = ["acme", "globex", "initech", "umbrella"]
REQUESTS_PER_TENANT = int(
    os.environ.get("ISOGATE_SOAK_REQUESTS_PER_TENANT", "8" if AT_SCALE else "20")
)
# The control serves every over-pool prompt (decode attends over up to a million positions per
# token on this CPU): a few are enough to see the leak; the differential rounds follow.
CONTROL_REQUESTS_PER_TENANT = 1 if AT_SCALE else 3
# ordinary, over-pool, abort: at scale fewer requests, so more of them over the pool.
MIX = (0.55, 0.3, 0.15) if AT_SCALE else (0.7, 0.15, 0.15)
TIMEOUT_S = 900.0 if AT_SCALE else 120.0
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
        started = time.monotonic()
        try:
            cluster.start()
            startup = {
                "layer": layer,
                "shape": dataclasses.asdict(SHAPE),
                "startup_s": round(time.monotonic() - started, 1),
                "rss_after_start": _footprint(cluster, "VmRSS"),
            }
            print("SOAK-STARTUP", json.dumps(startup), flush=True)
        except ClusterStartError as error:
            if attempt == 2 or "address already in use" not in str(error):
                raise
            continue
        try:
            yield cluster
        finally:
            print("SOAK-PEAK", json.dumps(_footprint(cluster, "VmHWM")), flush=True)
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
        model=SHAPE.model,  # type: ignore[arg-type]
    )
    env = {**COMMON_ENV, **LAYER_ENV[layer]}
    extra: tuple[str, ...] = ()
    if SHAPE.max_running_requests is not None:
        extra = ("--max-running-requests", str(SHAPE.max_running_requests))
    return PDCluster(
        dataclasses.replace(
            spec,
            prefill=dataclasses.replace(spec.prefill, env=env, extra_args=extra),
            decode=dataclasses.replace(spec.decode, env=env, extra_args=extra),
        ),
        startup_timeout_s=900,
    )


def _memory_mib(pgid: int | None, field_name: str) -> float:
    """A status field (VmRSS now, VmHWM peak) summed over a server's process group, in MiB."""
    total_kib = 0
    for pid in group_members(pgid) if pgid else []:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field_name + ":"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return round(total_kib / 1024, 1)


def _footprint(cluster: PDCluster, field_name: str) -> dict[str, float]:
    return {
        "prefill_mib": _memory_mib(cluster.prefill.pid, field_name),
        "decode_mib": _memory_mib(cluster.decode.pid, field_name),
    }


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


def _bypassing_the_gateway(cluster: PDCluster) -> Any:
    """A sender straight to the pair's workers, as a client with no gateway in front would."""
    return bypass_sender(
        cluster.prefill_url,
        cluster.decode_url,
        cluster.bootstrap_port,
        cluster.spec.model_dir / "tokenizer.json",
        timeout_s=TIMEOUT_S,
    )


# engine_patch's own record of a refusal (engine_patch.events), one line per refused request.
_ENGINE_PATCH_REFUSAL = re.compile(
    r"isogate-engine: refused reason=(?P<reason>\w+) rid=(?P<rid>\S+)"
)


def _report(tmp_path: Path, name: str, counts: dict[str, object]) -> None:
    line = json.dumps({"run": name, **counts})
    print("SOAK", line)
    (tmp_path / f"soak-{name}.json").write_text(line)


def _assert_differential_sees_nothing_foreign(counts: dict[str, object]) -> None:
    differential = counts["differential"]
    assert isinstance(differential, dict)
    assert differential["rounds"] == SHAPE.probe_rounds
    assert differential["probe_refused"] == SHAPE.probe_rounds, "an over-pool probe was served"
    assert differential["changes"] == 0
    assert differential["honest_changes"] == 0


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
    tokens = counts["over_pool_tokens"]  # [fewest, most], as counted by who refused them
    assert isinstance(tokens, list) and SHAPE.prefill_pool < tokens[0] <= tokens[1]
    assert tokens[1] <= SHAPE.context_length
    assert counts["served"] > 0


def test_gateway_alone_holds_the_incident_shape_and_the_bypass_control_leaks(
    tmp_path: Path, memory_for_a_pair: None
) -> None:
    with incident_cluster(tmp_path / "logs", "gateway_only") as cluster:
        # Control first, on the fresh pair, the gateway bypassed, over-pool prompts only: its
        # differential rounds then see each round's traffic against little else.
        control = Soak(
            SHAPE, make_tenants(TENANTS[:3]), CONTROL_REQUESTS_PER_TENANT, mix=(0.0, 1.0, 0.0)
        )
        control_counts = control.run(_bypassing_the_gateway(cluster)).to_json()
        _report(tmp_path, "control-no_layer", control_counts)
        policies = write_policies(
            tmp_path / "policies",
            model_name=SHAPE.model,
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
            soak = Soak(SHAPE, tenants, REQUESTS_PER_TENANT, mix=MIX)
            counts = soak.run(gateway_sender(gateway.url, timeout_s=TIMEOUT_S)).to_json()
            _report(tmp_path, "gateway_on-engine_patch_off", counts)
    _assert_held(counts)
    assert counts["verification_failures"] == 0
    assert counts["refusals"] == {
        "gateway:400:context_length_exceeded": counts["by_kind"]["over_pool"]  # type: ignore[index]
    }
    _assert_differential_sees_nothing_foreign(counts)
    assert control_counts["over_pool_served"] > 0, (
        "the control did not leak: the soak cannot see the incident"
    )
    differential = control_counts["differential"]
    assert isinstance(differential, dict) and differential["honest_changes"] == 0
    assert differential["changes"] > 0, (
        "the control's probe gave the same output after different traffic of other tenants: "
        "the detector cannot show that what leaked was theirs"
    )


def _engine_patch_refusals(cluster: PDCluster) -> dict[str, str]:
    """The request id and reason of each refusal engine_patch logged, on either worker."""
    refused: dict[str, str] = {}
    for log_path in cluster.logs.values():
        for match in _ENGINE_PATCH_REFUSAL.finditer(log_path.read_text(errors="replace")):
            refused[match["rid"]] = match["reason"]
    return refused


def test_engine_patch_alone_holds_the_incident_shape_with_the_gateway_bypassed(
    tmp_path: Path, memory_for_a_pair: None
) -> None:
    with incident_cluster(tmp_path / "logs", "engine_patch_only") as cluster:
        soak = Soak(SHAPE, make_tenants(TENANTS), REQUESTS_PER_TENANT, mix=MIX)
        counts = soak.run(_bypassing_the_gateway(cluster)).to_json()
        _report(tmp_path, "gateway_off-engine_patch_on", counts)
        refused_by_engine_patch = _engine_patch_refusals(cluster)
    _assert_held(counts)
    _assert_differential_sees_nothing_foreign(counts)
    # Who refused: decode answers an over-pool prompt with a non-200 whoever stopped it (its
    # transfer fails once prefill drops the request), and unpatched SGLang with its own
    # admission fix stops it too. Only engine_patch's log line for the request's id shows that
    # engine_patch was the one.
    sent = soak.counts.over_pool_generations
    assert len(sent) == counts["by_kind"]["over_pool"]  # type: ignore[index]
    not_by_engine_patch = [rid for rid in sent if rid not in refused_by_engine_patch]
    assert not not_by_engine_patch, (
        f"{len(not_by_engine_patch)} of {len(sent)} over-pool prompts were stopped, but not by "
        f"engine_patch (no refusal of theirs in its log): {not_by_engine_patch[:3]}; "
        f"what the client saw: {counts['refusals']}"
    )
