"""Start and stop a local SGLang prefill/decode pair on the CPU (development and tests only).

Runs in the gateway venv (stdlib + httpx): it spawns the ENGINE venv's python, never
imports torch or sglang. Each server runs in its own process group, so stopping it kills
SGLang's scheduler and detokenizer children too. The flags are the ones that make SGLang
0.5.23 run PD on a CPU (see shared notes/sglang-cpu.md); `--enable-metrics` because the
gateway polls `/metrics`.

    python -m gateway.dev.cluster            # start the pair, print URLs, block until Ctrl-C
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

import httpx

from gateway.dev import deepseek_model
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.observability.logs import open_log_file

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
DEFAULT_PREFILL_PORT = 30000
DEFAULT_DECODE_PORT = 30010
DEFAULT_BOOTSTRAP_PORT = 30020
DEFAULT_ROUTER_PORT = 30030
DEFAULT_ROUTER_PROMETHEUS_PORT = 30031
DEFAULT_MAX_TOTAL_TOKENS = 8192
STARTUP_TIMEOUT_S = 240.0
STOP_GRACE_S = 10.0
LOG_TAIL_BYTES = 4000

# Environment that makes SGLang take its CPU path and Mooncake use TCP on loopback.
CPU_ENGINE_ENV: Mapping[str, str] = {"SGLANG_USE_CPU_ENGINE": "1", "MOONCAKE_PROTOCOL": "tcp"}
# The CPU shim plugin (engine/cpu, `fork_workers`) then forks a server's scheduler and
# detokenizer instead of spawning them: they inherit its imports rather than repeating them,
# which is most of what a CPU server costs to start.
FORK_WORKERS_ENV: Mapping[str, str] = {"ISOGATE_CPU_FORK_WORKERS": "1"}
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    # The weights come with the model (gateway/dev/model.py): biased so grammars terminate.
    "--attention-backend", "torch_native",
    "--skip-server-warmup",
    # A prefix-cache hit with the overlap scheduler raised "dummy base class Event" on CPU.
    "--disable-overlap-schedule",
    "--disaggregation-transfer-backend", "mooncake",
    "--enable-metrics",
    # Without it an idle scheduler busy-polls: an idle CPU pair burned ~1.2 of this machine's
    # 2 cores, starving everything else. It sleeps only when every queue (PD ones too) is empty
    # and a request on the tokenizer socket wakes it at once.
    "--sleep-on-idle",
    # Structured output (xgrammar, the default backend) as compact JSON: with any whitespace
    # allowed, a random-weight model's indentation alone fills max_tokens.
    "--constrained-json-disable-any-whitespace",
    # The gateway's fair queue sends each request's place as its priority
    # (gateway.core.fair_queue.engine_priority): prefill's waiting queue and decode's queues
    # are ordered by it, and decode retracts the lowest first when its KV pool runs out. A
    # request without one (SGLang's health check) is normal work beyond its share
    # (fair_queue.ENGINE_DEFAULT_PRIORITY).
    "--enable-priority-scheduling",
    "--default-priority-value", "200",
    "--retraction-policy", "priority",
    # Decode admits a transferred request only while its free pool exceeds this many tokens
    # per request it holds (SGLang's default: 512). The gateway has already claimed every
    # request's prompt + max_tokens + margin of the pool, so its margin is reserve enough;
    # with 512, a request the gateway let in waited in decode's prealloc queue for room the
    # gateway had counted, while prefill busy-polled it and the batch's throughput halved.
    "--num-reserved-decode-tokens", "16",
)  # fmt: skip


DevModel = Literal["tiny-llama", "deepseek-v4-tiny"]


def ensure_dev_model(model: DevModel, directory: Path | None = None) -> Path:
    """The dev model's directory, generated first if missing or stale (tiny-llama: the
    default, a 512-entry tokenizer; deepseek-v4-tiny: DeepSeek-V4's real tokenizer)."""
    if model == "deepseek-v4-tiny":
        return deepseek_model.ensure_deepseek_model(directory or deepseek_model.DEFAULT_MODEL_DIR)
    return ensure_tiny_model(directory or DEFAULT_MODEL_DIR)


class ClusterStartError(RuntimeError):
    """A server died or did not become ready; the message carries its log tail."""


@dataclass(frozen=True)
class WorkerSpec:
    mode: Literal["prefill", "decode"]
    port: int
    bootstrap_port: int | None = None  # prefill only: where decode fetches KV handoff info
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS  # KV pool size; unset, it took 14.9 GB
    context_length: int | None = None
    page_size: int | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    prefill: WorkerSpec
    decode: WorkerSpec
    log_dir: Path
    engine_python: Path
    # False: SGLang's own `spawn`, as on a GPU, where each child loads the plugins itself.
    fork_workers: bool = True


def cpu_threads_env() -> dict[str, str]:
    """Each of the pair's two workers one half of the CPUs this process may use, unless
    ``OMP_NUM_THREADS`` is set already.

    Why: torch on the CPU runs as many threads as there are CPUs, and SGLang binds them to
    cores only on AMX and arm64 machines. Two workers of one pair, each with a thread on every
    core, took turns at every core: a quiet tenant waited far longer beside a flood, and the
    pair made fewer tokens (measured in docs/operations.md section 9).
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2))}


def default_engine_python() -> Path:
    venv = os.environ.get("ENGINE_VENV") or str(REPO_ROOT / ".venv-engine")
    return Path(venv) / "bin" / "python"


def default_cluster_spec(
    *,
    model_dir: Path | None = None,
    log_dir: Path | None = None,
    engine_python: Path | None = None,
    prefill_port: int = DEFAULT_PREFILL_PORT,
    decode_port: int = DEFAULT_DECODE_PORT,
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
    prefill_max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
    decode_max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
    context_length: int | None = None,
    page_size: int | None = None,
    model: DevModel = "tiny-llama",
) -> ClusterSpec:
    """A prefill/decode pair of the tiny model (generated if missing) on loopback.

    `context_length` defaults to the smaller pool: the model advertises 65536 positions, and
    the production plugin (engine_patch) refuses to start a worker whose KV pool is smaller
    than its context length. Pass a larger one (with the plugin's opt-out) to build the
    incident's shape on purpose.
    """
    if context_length is None:
        context_length = min(prefill_max_total_tokens, decode_max_total_tokens)
    return ClusterSpec(
        model_dir=ensure_dev_model(model, model_dir),
        prefill=WorkerSpec(
            mode="prefill",
            port=prefill_port,
            bootstrap_port=bootstrap_port,
            max_total_tokens=prefill_max_total_tokens,
            context_length=context_length,
            page_size=page_size,
        ),
        decode=WorkerSpec(
            mode="decode",
            port=decode_port,
            max_total_tokens=decode_max_total_tokens,
            context_length=context_length,
            page_size=page_size,
        ),
        log_dir=log_dir or REPO_ROOT / ".run" / "logs",
        engine_python=engine_python or default_engine_python(),
    )


def server_command(worker: WorkerSpec, model_dir: Path, engine_python: Path) -> list[str]:
    command = [
        str(engine_python), "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--host", HOST,
        "--port", str(worker.port),
        "--max-total-tokens", str(worker.max_total_tokens),
        *CPU_SERVER_ARGS,
        "--disaggregation-mode", worker.mode,
    ]  # fmt: skip
    if worker.mode == "prefill":
        if worker.bootstrap_port is None:
            raise ValueError("a prefill worker needs a bootstrap_port")
        command += ["--disaggregation-bootstrap-port", str(worker.bootstrap_port)]
    else:
        # The default retraction backup pins host memory, which needs CUDA.
        command += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        # Each stream chunk carries what it adds, not the whole output so far
        # (``docs/operations.md``: the gateway reads either, this one for a cost per token).
        command += ["--incremental-streaming-output"]
    if worker.context_length is not None:
        command += ["--context-length", str(worker.context_length)]
    if worker.page_size is not None:
        command += ["--page-size", str(worker.page_size)]
    return command + list(worker.extra_args)


class ManagedProcess:
    """A child process in its own process group, logging to a file; stop() kills the group."""

    def __init__(
        self, name: str, command: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.command = list(command)
        self.env = dict(env)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open_log_file(self.log_path)  # a restart appends: what came before is evidence
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,  # own process group: killpg reaches every descendant
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def exit_code(self) -> int | None:
        return self._process.poll() if self._process else None

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the process has ended; None if it still runs after ``timeout_s``."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, size: int = LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-size:].decode("utf-8", "replace")

    def terminate(self) -> None:
        """Ask the group to exit (SIGTERM) without waiting; stop() finishes the job."""
        if self._process is not None:
            _signal_group(self._process.pid, signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the group, SIGKILL it after `grace_s`, reap the leader, wait for the rest."""
        process = self._process
        if process is not None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # SGLang's children may outlive a SIGTERMed parent: kill the whole group anyway.
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
            _wait_group_gone(process.pid, timeout_s=STOP_GRACE_S)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.1)


def _wait_until_ready(
    processes: Mapping[str, tuple[ManagedProcess, str]], timeout_s: float
) -> None:
    """Poll each `(process, url)` until it answers 200; fail fast if one exits."""
    pending = dict(processes)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while pending:
            for name, (process, url) in list(pending.items()):
                code = process.exit_code()
                if code is not None:
                    raise ClusterStartError(
                        f"{name} exited with code {code} during start-up "
                        f"(log {process.log_path}):\n{process.log_tail()}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {name} ({p.log_path}):\n{p.log_tail()}"
                    for name, (p, _) in pending.items()
                )
                raise ClusterStartError(
                    f"not ready after {timeout_s:.0f}s: {sorted(pending)}\n{tails}"
                )
            time.sleep(0.5)


class PDCluster:
    """One SGLang prefill server and one decode server on the CPU, as a context manager."""

    def __init__(self, spec: ClusterSpec, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self.prefill = self._managed(spec.prefill)
        self.decode = self._managed(spec.decode)

    def _managed(self, worker: WorkerSpec) -> ManagedProcess:
        return ManagedProcess(
            name=f"sglang-{worker.mode}",
            command=server_command(worker, self.spec.model_dir, self.spec.engine_python),
            env={
                **CPU_ENGINE_ENV,
                **cpu_threads_env(),
                **(FORK_WORKERS_ENV if self.spec.fork_workers else {}),
                **worker.env,
            },
            log_path=self.spec.log_dir / f"sglang-{worker.mode}-{worker.port}.log",
        )

    @property
    def prefill_url(self) -> str:
        return self.spec.prefill.url

    @property
    def decode_url(self) -> str:
        return self.spec.decode.url

    @property
    def bootstrap_port(self) -> int:
        assert self.spec.prefill.bootstrap_port is not None
        return self.spec.prefill.bootstrap_port

    @property
    def logs(self) -> dict[str, Path]:
        return {"prefill": self.prefill.log_path, "decode": self.decode.log_path}

    def start(self) -> None:
        """Launch both servers in parallel and wait until each serves a generation."""
        try:
            self.prefill.start()
            self.decode.start()
            _wait_until_ready(
                {
                    "prefill": (self.prefill, f"{self.prefill_url}/health_generate"),
                    "decode": (self.decode, f"{self.decode_url}/health_generate"),
                },
                self.startup_timeout_s,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        # Both shut down at once: each may take its whole grace period on a busy machine.
        self.decode.terminate()
        self.prefill.terminate()
        self.decode.stop()
        self.prefill.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RouterProcess:
    """`sglang_router` (SGLang's Rust PD router, the upstream peer) in front of a PDCluster."""

    def __init__(
        self,
        cluster: PDCluster,
        port: int = DEFAULT_ROUTER_PORT,
        prometheus_port: int = DEFAULT_ROUTER_PROMETHEUS_PORT,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        command = [
            str(cluster.spec.engine_python), "-m", "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill", cluster.prefill_url, str(cluster.bootstrap_port),
            "--decode", cluster.decode_url,
            "--host", HOST,
            "--port", str(port),
            "--prometheus-host", HOST,
            "--prometheus-port", str(prometheus_port),  # default 29000 is outside our range
        ]  # fmt: skip
        self.process = ManagedProcess(
            name="sglang-router",
            command=command,
            env={},
            log_path=cluster.spec.log_dir / f"sglang-router-{port}.log",
        )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        try:
            self.process.start()
            # /health answers 200 before the workers register; /readiness waits for them.
            _wait_until_ready(
                {"router": (self.process, f"{self.url}/readiness")}, self.startup_timeout_s
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a CPU SGLang PD pair of the tiny model.")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--model", choices=["tiny-llama", "deepseek-v4-tiny"], default="tiny-llama")
    parser.add_argument("--prefill-port", type=int, default=DEFAULT_PREFILL_PORT)
    parser.add_argument("--decode-port", type=int, default=DEFAULT_DECODE_PORT)
    parser.add_argument("--bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT)
    parser.add_argument("--max-total-tokens", type=int, default=DEFAULT_MAX_TOTAL_TOKENS)
    parser.add_argument("--router-port", type=int, default=None, help="also start sglang_router")
    args = parser.parse_args(argv)
    spec = default_cluster_spec(
        model_dir=args.model_dir,
        model=args.model,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port,
        prefill_max_total_tokens=args.max_total_tokens,
        decode_max_total_tokens=args.max_total_tokens,
    )
    # Ctrl-C and SIGTERM (e.g. from make) unwind through the context managers, which kill the
    # servers. SIGINT is set explicitly: a shell's background job starts with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    print(f"starting SGLang PD pair (logs in {spec.log_dir}) ...", flush=True)
    try:
        with PDCluster(spec) as cluster:
            print(f"model     {spec.model_dir}", flush=True)
            print(f"prefill   {cluster.prefill_url}  bootstrap port {cluster.bootstrap_port}")
            print(f"decode    {cluster.decode_url}")
            print(f"ready in {time.monotonic() - started:.1f}s; Ctrl-C stops", flush=True)
            if args.router_port is None:
                _block_forever()
            else:
                with RouterProcess(cluster, port=args.router_port) as router:
                    print(f"router    {router.url}", flush=True)
                    _block_forever()
    except KeyboardInterrupt:
        pass
    except ClusterStartError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


def _block_forever() -> None:
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
