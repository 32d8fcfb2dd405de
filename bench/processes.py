"""The processes a bench starts (instant backends, ``sglang_router``, SMG, the gateway), each in
a process group of its own (``ManagedProcess``), maybe pinned, and what /proc says of them."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from gateway.dev.cluster import ManagedProcess, group_members
from gateway.dev.harness import GatewayProcess, port_is_free

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = Path(os.environ.get("ENGINE_VENV") or REPO_ROOT / ".venv-engine") / "bin" / "python"
# SMG in a venv of its own (scripts/bench installs it); a bench without it leaves SMG out.
SMG_BINARY = REPO_ROOT / ".venv-smg" / "bin" / "smg"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of ``pid`` (new threads inherit it)."""
    if not cpus:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def free_ports(first: int, count: int = 1, limit: int = 10) -> int:
    """The first port from ``first`` such that it and the next ``count - 1`` are free (other
    sessions' tests bind random ports in the kernel's ephemeral range, which holds ours)."""
    for start in range(first, first + limit):
        if all(port_is_free(port) for port in range(start, start + count)):
            return start
    raise RuntimeError(f"no {count} free port(s) in {first}..{first + limit + count - 2}")


def boost(pid: int, nice: int) -> None:
    """Raise a process's CPU share on a shared machine (0: leave it alone); under autogroup
    scheduling the group's nice is what counts."""
    if nice == 0:
        return
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def group_cpu_seconds(pgid: int) -> float:
    """CPU time of every live process of a process group (a launcher and what it started)."""
    total = 0.0
    for pid in group_members(pgid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += cpu_seconds(pid)
    return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Server:
    """A process the bench started, in a process group of its own, and its port."""

    process: ManagedProcess
    port: int

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def serve(
    name: str, command: list[str], log_dir: Path, port: int, ready: str, *,
    cpus: set[int] | None, priority: int, timeout_s: float = 20,
) -> Server:  # fmt: skip
    """Start ``command`` pinned to ``cpus`` (every thread, from its first: ``taskset``) and wait
    until ``GET ready`` answers 200."""
    pinned = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
    process = ManagedProcess(name, [*pinned, *command], {}, log_dir / f"{name}-{port}.log")
    process.start()
    server = Server(process, port)
    boost(server.pid, priority)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.exit_code() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.exit_code()}\n{process.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + ready, timeout=2).status_code == 200:
                    return server
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready on {server.url + ready} after {timeout_s:.0f} s")
    except BaseException:
        process.stop()
        raise


@dataclass(frozen=True)
class BenchPool:
    prefill_url: str
    bootstrap_port: int
    decode_url: str


def instant_backend(
    role: str, port: int, log_dir: Path, *, cpus: set[int] | None, pool_tokens: int,
    chunks: int = 4, stream_interval_s: float = 0.0, priority: int = 0,
) -> Server:  # fmt: skip
    port = free_ports(port)
    arguments = f"--role {role} --port {port} --pool-tokens {pool_tokens} --chunks {chunks}"
    command = [sys.executable, "-m", "bench.instant_backend", *arguments.split()]
    command += ["--stream-interval-s", str(stream_interval_s)]
    return serve(f"instant-{role}", command, log_dir, port, "/health", cpus=cpus, priority=priority)


def python_relay(
    pool: BenchPool, port: int, log_dir: Path, *, cpus: set[int] | None, priority: int = 0
) -> Server:
    """``bench.python_relay`` in front of ``pool``: section 1's floor, the gateway's HTTP stack
    relaying to the pair with none of its checks."""
    port = free_ports(port)
    arguments = f"--port {port} --prefill {pool.prefill_url} --decode {pool.decode_url}"
    arguments += f" --bootstrap-port {pool.bootstrap_port}"
    command = [sys.executable, "-m", "bench.python_relay", *arguments.split()]
    return serve("python-relay", command, log_dir, port, "/health", cpus=cpus, priority=priority)


def pd_router(
    kind: str, pool: BenchPool, port: int, log_dir: Path, *, cpus: set[int] | None,
    priority: int = 0, models: Sequence[str] = (),
) -> Server:  # fmt: skip
    """A Rust PD router in front of one pair: ``sglang-router`` (engine venv) or ``smg``, which
    routes by model: each of ``models`` becomes an alias of the workers' model path."""
    for attempt in range(3):
        port = free_ports(port, count=2)  # the router's port and its Prometheus port
        arguments = (
            f"--pd-disaggregation --prefill {pool.prefill_url} {pool.bootstrap_port} "
            f"--decode {pool.decode_url} --host 127.0.0.1 --port {port} "
            f"--prometheus-host 127.0.0.1 --prometheus-port {port + 1} --log-level warn "
            "--worker-startup-check-interval 1"
        ).split()
        if kind == "smg":
            info = httpx.get(f"{pool.prefill_url}/server_info", timeout=10).json()
            aliases = [a for m in models for a in ("--model-alias", f"{m}={info['model_path']}")]
            command = [str(SMG_BINARY), "launch", *arguments, *aliases]
        else:
            command = [str(ENGINE_PYTHON), "-m", "sglang_router.launch_router", *arguments]
        try:
            placed = {"cpus": cpus, "priority": priority}
            return serve(kind, command, log_dir, port, "/readiness", **placed, timeout_s=90)
        except RuntimeError as exc:
            # A client socket may hold one of our ports for a moment: wait and try again.
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
            time.sleep(3)
    raise AssertionError("unreachable")


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
    entries = []
    for m in models:
        prefill = [{"url": m.pool.prefill_url, "bootstrap_port": m.pool.bootstrap_port}]
        pool = {"name": "bench", "prefill": prefill, "decode": [{"url": m.pool.decode_url}]}
        entries.append({
            "name": m.name, "tokenizer": str(m.tokenizer_dir or tokenizer_dir),
            "max_context_tokens": m.max_context_tokens, "default_max_tokens": 16,
            "max_output_tokens": 1024, "require_engine_tags": m.require_engine_tags,
            "pools": [pool],
        })  # fmt: skip
    (directory / "models.yaml").write_text(yaml.safe_dump({"models": entries}))
    limits = {"requests_per_minute": 100_000_000, "tokens_per_minute": 2_000_000_000_000}
    limits["max_concurrent"] = 1_000_000
    tenants = {"defaults": {"isolation": "shared", "limits": limits}, "tenants": {}}
    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    return directory


def start_gateway(
    policies_dir: Path, work_dir: Path, port: int, *, cpus: set[int] | None,
    env: dict[str, str] | None = None, priority: int = 0, root: Path | None = None,
    workers: int = 1, granian: bool = False,
) -> tuple[GatewayProcess, str]:  # fmt: skip
    """``python -m gateway serve [--workers N]`` (of ``root``'s checkout, ours by default), or
    with ``granian`` the same app under granian instead of uvicorn, every process pinned;
    returns it and a tenant key."""
    env = {"ISOGATE_CAPACITY_POLL_INTERVAL_S": "1.0", **(env or {})}
    port = free_ports(port)
    # granian in place of ``serve``: ``python -c`` takes the serve command after it as argv.
    options = "--interface asgi --factory --loop uvloop --http 1 --no-ws --log-level warning "
    options += f"--port {port} gateway.cli.main:worker_app"
    served = [sys.executable, "-c", f"from granian.cli import cli; cli({options.split()!r})"]
    gateway = GatewayProcess(
        policies_dir, work_dir, env, port, root=root or REPO_ROOT, workers=workers,
        command_prefix=served if granian else [],
    )  # fmt: skip
    try:
        gateway.start()
        assert gateway.process is not None
        for pid in group_members(gateway.process.pid):  # every worker process
            pin(pid, cpus)
            boost(pid, priority)
        _, key = gateway.create_tenant("bench-tenant")
    except BaseException:
        gateway.stop()
        raise
    return gateway, key
