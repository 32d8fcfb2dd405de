"""Session-wide fixtures: ONE real SGLang PD pair on the CPU and one gateway in front of it.

A PD pair takes about 35 s and 4.5 GB to start, so every end-to-end test shares this one;
tests that need another shape (the incident's) start their own and stop it.

``make test`` runs the suite on two pytest-xdist workers: much of it waits (on a pair
starting, a timeout, a fault) while the other core is idle. Each module runs whole on one
worker (its module fixtures and its fixed ports are never set up twice at once), and every
module that uses the session pair runs on the same worker, so the pair starts once. The
modules are handed out longest first (``schedule_order``; ``make test`` passes
``--no-loadscope-reorder`` so that xdist keeps that order).

A pair that stops serving fails every later test on it, far from the cause. So after each
module on the session pair the pair must be idle again (``session_pair_left_idle``), and the
first failing test on it carries the tails of its logs (``pytest_runtest_makereport``).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.dev.cluster import (
    ClusterSpec,
    PDCluster,
    RouterProcess,
    default_cluster_spec,
    default_engine_python,
)
from gateway.dev.harness import GatewayProcess
from tests.harness import PoolSpec, write_policies

MODEL = "tiny-llama"
# The same model under a policy without tool calling (the session gateway serves both).
PLAIN_MODEL = "tiny-llama-plain"
# Ports of the shared session cluster (other suites use other ranges).
SESSION_PREFILL_PORT, SESSION_DECODE_PORT, SESSION_BOOTSTRAP_PORT = 32000, 32001, 32002
SESSION_ROUTER_PORT, SESSION_ROUTER_PROMETHEUS_PORT = 32003, 32004
SESSION_POOL_TOKENS = 8192

# Every SGLang server a test starts inherits this process's environment. On SIGTERM (every
# PDCluster.stop) SGLang 0.5.23's tokenizer manager sees its scheduler die and, before it
# exits, sleeps 5 s "to let GPU activity settle" for a py-spy dump and a CUDA coredump
# (SGLANG_PYSPY_DUMP_BEFORE_CRASH / SGLANG_CUDA_COREDUMP_BEFORE_CRASH, both on by default):
# 5 s of every stop, and neither dump exists on this CPU-only machine (no py-spy installed).
os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")


SESSION_FIXTURES = frozenset({"pd_cluster", "pd_router", "gateway", "tenant"})
SESSION_GROUP = "session-pair"
# The modules that use the session pair (set at collection), and the pair while it runs.
SESSION_MODULES = pytest.StashKey[frozenset[str]]()
RUNNING_PAIR = pytest.StashKey["PDCluster | ExternalCluster"]()
# The first module after which the pair was found busy (the later ones may only inherit it).
PAIR_BUSY_SINCE = pytest.StashKey[str]()
# How long a module's last requests may take to leave the pair once the module is done.
PAIR_IDLE_WAIT_S = 60.0
# A server is idle when each of these is 0 on every rank.
IDLE_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")


# First: xdist's own hook reads the groups (into each test's node ID) in the same hook, and a
# group added after it reads them is no group at all.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The xdist group of each test (used by ``--dist loadgroup``): its module's, or the
    session pair's for every module where any test uses it; and the groups in the order they
    are to be handed out (``schedule_order``)."""
    on_session_pair = {
        item.module.__name__
        for item in items
        if isinstance(item, pytest.Function) and SESSION_FIXTURES & set(item.fixturenames)
    }
    config.stash[SESSION_MODULES] = frozenset(on_session_pair)
    groups: dict[pytest.Item, str] = {}
    for item in items:
        module = item.module.__name__ if isinstance(item, pytest.Function) else item.nodeid
        group = groups[item] = SESSION_GROUP if module in on_session_pair else module
        item.add_marker(pytest.mark.xdist_group(group))
    items[:] = schedule_order(items, groups)


# Set once a failing test has carried the session pair's logs (they are the same for the next).
PAIR_LOGS_REPORTED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The first failing test on the session pair carries the tails of the pair's logs.

    A pair that stops answering shows up in a test as a read timeout, and the logs are in a
    temporary folder of a CI machine nobody can open afterwards: what the servers said last is
    the only evidence there will be. Once per worker; the next failures would repeat it.
    """
    report: pytest.TestReport = yield
    cluster = getattr(item, "funcargs", {}).get("pd_cluster")
    if (
        report.failed
        and isinstance(cluster, PDCluster)
        and not item.config.stash.get(PAIR_LOGS_REPORTED, False)
    ):
        item.config.stash[PAIR_LOGS_REPORTED] = True
        for name, process in (("prefill", cluster.prefill), ("decode", cluster.decode)):
            report.sections.append((f"session pair: {name} log, last lines", process.log_tail()))
    return report


def schedule_order(items: list[pytest.Item], groups: dict[pytest.Item, str]) -> list[pytest.Item]:
    """The tests, group by group, longest groups first, for ``--no-loadscope-reorder``.

    xdist hands a worker the next group in collection order whenever it runs dry, so the
    suite's length is that of the busiest worker: long groups handed out last leave the other
    worker idle meanwhile (longest first is the classic rule). xdist's own order (most tests
    first) is the wrong one here: the groups that start SGLang pairs of their own have few
    tests, and each of their tests waits on a pair for most of its time. So: first those
    groups (real-engine tests not on the session pair), then the session pair's, then the
    others, most tests first within each class.
    """
    members: dict[str, list[pytest.Item]] = {}
    for item in items:
        members.setdefault(groups[item], []).append(item)

    def rank(group: str) -> tuple[int, int]:
        tests = members[group]
        if group == SESSION_GROUP:
            kind = 1
        elif any(item.get_closest_marker("engine") for item in tests):
            kind = 0  # starts pairs of its own
        else:
            kind = 2
        return kind, -len(tests)

    return [item for group in sorted(members, key=rank) for item in members[group]]


@dataclass(frozen=True)
class ExternalCluster:
    """A PD pair someone else runs (``ISOGATE_TEST_CLUSTER=prefill_url,decode_url,bootstrap_port``),
    for fast iteration while developing; CI never sets it."""

    prefill_url: str
    decode_url: str
    bootstrap_port: int
    spec: ClusterSpec


@pytest.fixture(scope="session")
def pd_cluster(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[PDCluster | ExternalCluster]:
    external = os.environ.get("ISOGATE_TEST_CLUSTER")
    if external:
        prefill_url, decode_url, bootstrap_port = external.split(",")
        spec = default_cluster_spec(log_dir=tmp_path_factory.mktemp("unused"))
        pytestconfig.stash[RUNNING_PAIR] = ExternalCluster(
            prefill_url, decode_url, int(bootstrap_port), spec
        )
        yield pytestconfig.stash[RUNNING_PAIR]
        return
    engine_python = default_engine_python()
    if not engine_python.exists():
        pytest.fail(f"{engine_python} is missing: `make test` installs it (scripts/install-engine)")
    spec = default_cluster_spec(
        log_dir=tmp_path_factory.mktemp("session-sglang-logs"),
        prefill_port=SESSION_PREFILL_PORT,
        decode_port=SESSION_DECODE_PORT,
        bootstrap_port=SESSION_BOOTSTRAP_PORT,
        prefill_max_total_tokens=SESSION_POOL_TOKENS,
        decode_max_total_tokens=SESSION_POOL_TOKENS,
        # A safe deployment: no prompt under the context length can exceed a pool.
        context_length=SESSION_POOL_TOKENS,
    )
    with PDCluster(spec) as cluster:
        pytestconfig.stash[RUNNING_PAIR] = cluster
        try:
            yield cluster
        finally:
            del pytestconfig.stash[RUNNING_PAIR]


@pytest.fixture(scope="module", autouse=True)
def session_pair_left_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each module on the session pair: the pair holds no request and no KV any more.

    Every later module shares the pair. A module that leaves a request or its pages held there
    (an abort that never reached a worker, a transfer nobody finishes) shrinks the pool for all
    that follow, and they fail one by one with timeouts, far from the cause. This names it.
    """
    yield
    cluster = request.config.stash.get(RUNNING_PAIR, None)
    if cluster is None or request.module.__name__ not in request.config.stash[SESSION_MODULES]:
        return
    busy = busy_workers(cluster, PAIR_IDLE_WAIT_S)
    if busy:
        module = request.module.__name__
        since = request.config.stash.setdefault(PAIR_BUSY_SINCE, module)
        pytest.fail(
            f"{module} left the session pair busy {PAIR_IDLE_WAIT_S:.0f} s after its last "
            f"test: {busy}" + (f" (it was busy already after {since})" if since != module else "")
        )


def busy_workers(cluster: PDCluster | ExternalCluster, wait_s: float) -> dict[str, object]:
    """What still runs, waits or holds KV pages on each server of the pair after ``wait_s``
    (SGLang's ``/v1/loads``; the prefix cache's pages are free to evict, so not counted);
    empty once both are idle."""
    urls = {"prefill": cluster.prefill_url, "decode": cluster.decode_url}
    deadline = time.monotonic() + wait_s
    while True:
        busy: dict[str, object] = {}
        for name, url in urls.items():
            try:
                ranks = httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                busy[name] = f"no loads: {exc!r}"
                continue
            held = [counts for counts in map(_held, ranks) if counts]
            if held:
                busy[name] = held
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


def _held(rank: dict[str, Any]) -> dict[str, int]:
    """A rank's counts of requests and pages that are not 0: its own, its PD queues' and
    its other queues' (grammar, paused, retracted)."""
    counts = {key: rank.get(key) for key in IDLE_FIELDS}
    counts |= {
        key: value
        for key, value in (rank.get("disaggregation") or {}).items()
        if key.endswith("_reqs")
    }
    counts |= {f"queue {key}": value for key, value in (rank.get("queues") or {}).items()}
    return {key: value for key, value in counts.items() if isinstance(value, int) and value}


@pytest.fixture(scope="session")
def pd_router(pd_cluster: PDCluster) -> Iterator[RouterProcess]:
    """sglang_router (the upstream peer) in front of the session pair, started once.

    Two tests used to start and stop one each: 16-19 s per test on this machine, though the
    router was ready within 2 s of starting and answered in under 0.5 s. On SIGTERM it logs
    "starting graceful shutdown" and nothing after, and ManagedProcess waits 10 s for it before
    its SIGKILL; here it gets 1 s (it holds nothing anyone reads afterwards).
    """
    router = RouterProcess(
        pd_cluster, port=SESSION_ROUTER_PORT, prometheus_port=SESSION_ROUTER_PROMETHEUS_PORT
    )
    router.start()
    try:
        yield router
    finally:
        router.process.stop(grace_s=1.0)


@pytest.fixture(scope="session")
def gateway(
    pd_cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    work = tmp_path_factory.mktemp("gateway")
    policies = write_policies(
        work / "policies",
        model_name=MODEL,
        tokenizer_dir=pd_cluster.spec.model_dir,
        pools=[
            PoolSpec(
                "shared",
                ((pd_cluster.prefill_url, pd_cluster.bootstrap_port),),
                (pd_cluster.decode_url,),
            )
        ],
        require_engine_tags=os.environ.get("ISOGATE_TEST_REQUIRE_ENGINE_TAGS", "1") == "1",
        # The dev model's template writes calls in the Qwen 2.5 format; its twin has no parser.
        tool_call_parser="qwen25",
        plain_twin=PLAIN_MODEL,
    )
    with GatewayProcess(policies_dir=policies, work_dir=work) as process:
        yield process


@pytest.fixture(scope="session")
def tenant(gateway: GatewayProcess) -> tuple[str, str]:
    return gateway.create_tenant()


# ---- Redis, for the tests that use the real one --------------------------------------------

REDIS_URL = os.environ.get("ISOGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def redis_client() -> AsyncIterator[Any]:
    import redis.asyncio as redis_asyncio

    client = redis_asyncio.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.fail(f"Redis at {REDIS_URL} is not reachable ({exc}); set ISOGATE_TEST_REDIS_URL")
    yield client
    await client.aclose()


@pytest.fixture
async def redis_prefix(redis_client: Any) -> AsyncIterator[str]:
    prefix = "isogate-test-" + secrets.token_hex(6)
    yield prefix
    keys = [key async for key in redis_client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await redis_client.delete(*keys)
