"""The processes a bench runs: instant backends, ``sglang_router``, SMG, the gateway; pinning,
CPU and memory.

Every process runs in its own process group (``stop`` kills the group) and may be pinned to
a set of CPUs (all of its threads, including ones started later, since they inherit the
affinity of the thread that starts them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from gateway.dev.cluster import PDCluster, group_members
from gateway.dev.harness import GatewayProcess, port_is_free
from gateway.workers.capacity import ENGINE_PATCH_MARKER

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = Path(os.environ.get("ENGINE_VENV") or REPO_ROOT / ".venv-engine") / "bin" / "python"
# SMG (``smg`` on PyPI), in a virtual environment of its own: its grpcio and protobuf are newer
# than the engine's. ``scripts/bench`` installs it; a bench without it leaves SMG out.
SMG_BINARY = REPO_ROOT / ".venv-smg" / "bin" / "smg"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of ``pid`` (new threads inherit it)."""
    if not cpus:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass


def free_ports(first: int, count: int = 1, limit: int = 10) -> int:
    """The first port from ``first`` (within ``limit`` tries) such that it and the next
    ``count - 1`` are free. The bench's range lies inside the kernel's ephemeral range, where
    other sessions' tests bind random ports, so a fixed port is sometimes taken."""
    for start in range(first, first + limit):
        if all(port_is_free(port) for port in range(start, start + count)):
            return start
    raise RuntimeError(f"no {count} free port(s) in {first}..{first + limit + count - 2}")


def boost(pid: int, nice: int) -> None:
    """Raise a process's CPU share on a shared machine (0: leave it alone).

    With autogroup scheduling (``kernel.sched_autogroup_enabled``) every session competes as
    one group, whatever its processes' nice values, so the group's nice is what counts.
    """
    if nice == 0:
        return
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_http(
    url: str,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = (
                log.read_bytes()[-3000:].decode("utf-8", "replace") if log and log.exists() else ""
            )
            raise RuntimeError(f"{url}: process exited with {process.returncode}\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


@dataclass
class Managed:
    """A child process in its own process group, pinned, logging to a file."""

    name: str
    command: Sequence[str]
    log_path: Path
    cpus: set[int] | None = None
    env: dict[str, str] | None = None
    priority: int = 0  # see boost()
    port: int | None = None  # where it listens, once known
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Managed:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            cpus = self.cpus
            self.process = subprocess.Popen(
                list(self.command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        boost(self.process.pid, self.priority)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of the group
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None


def instant_backend(
    role: str,
    port: int,
    log_dir: Path,
    *,
    cpus: set[int] | None,
    pool_tokens: int,
    chunks: int = 4,
    stream_interval_s: float = 0.0,
    priority: int = 0,
) -> Managed:
    port = free_ports(port)
    command = [
        sys.executable,
        "-m",
        "bench.instant_backend",
        "--role",
        role,
        "--port",
        str(port),
        "--pool-tokens",
        str(pool_tokens),
        "--chunks",
        str(chunks),
        "--stream-interval-s",
        str(stream_interval_s),
    ]
    backend = Managed(
        f"instant-{role}", command, log_dir / f"instant-{role}-{port}.log", cpus, priority=priority
    ).start()
    wait_http(f"http://127.0.0.1:{port}/health", 20, backend.process, backend.log_path)
    backend.port = port
    return backend


def _pd_router_arguments(
    prefill_url: str, bootstrap_port: int, decode_url: str, port: int
) -> list[str]:
    """What both Rust routers (``sglang_router``, SMG) are told: one PD pair, their port and
    Prometheus port, warnings only, workers checked each second at start."""
    return [
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        str(bootstrap_port),
        "--decode",
        decode_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(port + 1),
        "--log-level",
        "warn",
        "--worker-startup-check-interval",
        "1",
    ]


def _router_command(prefill_url: str, bootstrap_port: int, decode_url: str, port: int) -> list[str]:
    return [
        str(ENGINE_PYTHON),
        "-m",
        "sglang_router.launch_router",
        *_pd_router_arguments(prefill_url, bootstrap_port, decode_url, port),
    ]


def sglang_router(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    port: int,
    log_dir: Path,
    *,
    cpus: set[int] | None,
    priority: int = 0,
) -> Managed:
    """SGLang's Rust PD router (``sglang_router`` 0.3.2, engine venv), ready on /readiness."""
    return _peer_router(
        "sglang-router",
        lambda at: _router_command(prefill_url, bootstrap_port, decode_url, at),
        port,
        log_dir,
        cpus=cpus,
        priority=priority,
    )


def _smg_command(
    prefill_url: str, bootstrap_port: int, decode_url: str, port: int, models: Sequence[str]
) -> list[str]:
    # SMG routes by model: the workers report their model path, the bench's clients name the
    # gateway's model, so each name is an alias of the path.
    model_path = httpx.get(f"{prefill_url}/server_info", timeout=10).json()["model_path"]
    aliases = [arg for name in models for arg in ("--model-alias", f"{name}={model_path}")]
    return [
        str(SMG_BINARY),
        "launch",
        *_pd_router_arguments(prefill_url, bootstrap_port, decode_url, port),
        *aliases,
    ]


def smg_router(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    port: int,
    log_dir: Path,
    *,
    models: Sequence[str],
    cpus: set[int] | None,
    priority: int = 0,
) -> Managed:
    """SMG (``smg launch``, PD mode, ``.venv-smg``) in front of one pair, ready on /readiness."""
    return _peer_router(
        "smg",
        lambda at: _smg_command(prefill_url, bootstrap_port, decode_url, at, models),
        port,
        log_dir,
        cpus=cpus,
        priority=priority,
    )


def _peer_router(
    name: str,
    command_at: Callable[[int], list[str]],
    port: int,
    log_dir: Path,
    *,
    cpus: set[int] | None,
    priority: int,
) -> Managed:
    """A Rust router started on ``port`` (and its Prometheus port next to it), ready on
    /readiness."""
    for attempt in range(3):
        port = free_ports(port, count=2)  # the router's port and its Prometheus port
        router = Managed(
            name, command_at(port), log_dir / f"{name}-{port}.log", cpus, priority=priority
        ).start()
        try:
            wait_http(f"http://127.0.0.1:{port}/readiness", 90, router.process, router.log_path)
            router.port = port
            return router
        except RuntimeError as exc:
            router.stop()
            # Our ports lie inside the kernel's ephemeral range: a client socket may hold one
            # for a moment (seen as "Address already in use"). Wait and try again.
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
            time.sleep(3)
        except BaseException:
            router.stop()
            raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class BenchPool:
    prefill_url: str
    bootstrap_port: int
    decode_url: str


@dataclass(frozen=True)
class BenchModel:
    name: str
    max_context_tokens: int
    pool: BenchPool
    require_engine_tags: bool = True
    tokenizer_dir: Path | None = None  # None: the policies' shared tokenizer


def write_bench_policies(
    directory: Path, *, tokenizer_dir: Path, models: Sequence[BenchModel]
) -> Path:
    """Policies for the bench models (one shared pool each) and tenant limits too high to matter."""
    directory.mkdir(parents=True, exist_ok=True)

    def pool(spec: BenchPool) -> dict:
        return {
            "name": "bench",
            "prefill": [{"url": spec.prefill_url, "bootstrap_port": spec.bootstrap_port}],
            "decode": [{"url": spec.decode_url}],
        }

    (directory / "models.yaml").write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": m.name,
                        "tokenizer": str(m.tokenizer_dir or tokenizer_dir),
                        "max_context_tokens": m.max_context_tokens,
                        "default_max_tokens": 16,
                        "max_output_tokens": 1024,
                        "require_engine_tags": m.require_engine_tags,
                        "pools": [pool(m.pool)],
                    }
                    for m in models
                ]
            }
        )
    )
    limits = {
        "requests_per_minute": 100_000_000,
        "tokens_per_minute": 2_000_000_000_000,
        "max_concurrent": 1_000_000,
    }
    (directory / "tenants.yaml").write_text(
        yaml.safe_dump({"defaults": {"isolation": "shared", "limits": limits}, "tenants": {}})
    )
    return directory


def group_cpu_seconds(pgid: int) -> float:
    """CPU time of every live process of a process group (a launcher and what it started)."""
    total = 0.0
    for pid in group_members(pgid):
        try:
            total += cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def start_gateway(
    policies_dir: Path,
    work_dir: Path,
    port: int,
    *,
    cpus: set[int] | None,
    env: dict[str, str] | None = None,
    priority: int = 0,
    root: Path | None = None,
    command_prefix: list[str] | None = None,
    timeout_s: float = 60,
) -> tuple[GatewayProcess, str]:
    """``python -m gateway serve`` (``gateway.dev.harness.GatewayProcess``), pinned; returns it
    and a tenant key.

    ``root``: run the ``gateway`` package of that directory instead of this checkout's;
    ``command_prefix``: run the server under it (callgrind, in ``bench.instructions``).
    """
    gateway = GatewayProcess(
        policies_dir=policies_dir,
        work_dir=work_dir,
        port=free_ports(port),
        env={"ISOGATE_CAPACITY_POLL_INTERVAL_S": "1.0", **(env or {})},
        root=root or REPO_ROOT,
        command_prefix=command_prefix or [],
    )
    try:
        gateway.start(timeout_s=timeout_s)
        assert gateway.process is not None
        pin(gateway.process.pid, cpus)
        boost(gateway.process.pid, priority)
        _, key = gateway.create_tenant("bench-tenant")
    except BaseException:
        gateway.stop()
        raise
    return gateway, key


@contextlib.contextmanager
def peers_in_front(
    cluster: PDCluster,
    work_dir: Path,
    *,
    router_port: int,
    gateway_port: int,
    model: str = "tiny-llama",
    root: Path | None = None,
) -> Iterator[tuple[Managed, GatewayProcess, str, bool]]:
    """sglang_router and the gateway (with a tenant key) in front of a running PD pair, and
    whether the pair runs engine_patch; both stopped on leaving."""
    info = httpx.get(f"{cluster.decode_url}/server_info", timeout=10).json()
    tags = bool(info.get(ENGINE_PATCH_MARKER))
    router = sglang_router(
        cluster.prefill_url,
        cluster.bootstrap_port,
        cluster.decode_url,
        router_port,
        work_dir,
        cpus=None,
    )
    try:
        pool = BenchPool(cluster.prefill_url, cluster.bootstrap_port, cluster.decode_url)
        policies = write_bench_policies(
            work_dir / "real-policies",
            tokenizer_dir=cluster.spec.model_dir,
            models=[BenchModel(model, cluster.spec.prefill.max_total_tokens, pool, tags)],
        )
        gateway, key = start_gateway(
            policies, work_dir / "real-gateway", gateway_port, cpus=None, root=root
        )
        try:
            yield router, gateway, key, tags
        finally:
            gateway.stop()
    finally:
        router.stop()
