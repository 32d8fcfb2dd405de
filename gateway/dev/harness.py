"""The gateway as a real process over real HTTP, for tests and the bench suite (development only).

``GatewayProcess`` runs ``python -m gateway serve`` in its own process group, with its own
SQLite file and settings, and makes tenants through its admin API, exactly as a client does;
``free_port`` and ``port_is_free`` pick the ports. Stdlib and httpx only: it never imports
pytest, the tests or the bench suite, and the production gateway never imports it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.observability.logs import open_log_file

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    """Bindable by a server: with SO_REUSEADDR, as servers bind, a port that only TIME_WAIT
    remnants of an earlier server hold counts as free."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class GatewayProcess:
    """``isogate serve`` in its own process group, with its own SQLite file and settings."""

    policies_dir: Path
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    admin_key: str = field(default_factory=lambda: "admin-" + secrets.token_hex(16))
    # Run the server under this (e.g. valgrind's callgrind, to count its instructions).
    command_prefix: list[str] = field(default_factory=list)
    # The checkout whose ``gateway`` package runs (a patched copy, for before/after figures).
    root: Path = REPO_ROOT
    # ``serve --workers``: gateway processes on the port (more than one needs Redis in ``env``).
    workers: int = 1
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"gateway-{self.port}.log"

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ISOGATE_")}
        env.update(
            ISOGATE_PORT=str(self.port),
            ISOGATE_POLICIES_DIR=str(self.policies_dir),
            ISOGATE_DATABASE_URL=f"sqlite:///{self.work_dir / 'isogate.db'}",
            ISOGATE_ADMIN_KEY=self.admin_key,
            ISOGATE_AUDIT_SPOOL_DIR=str(self.work_dir / f"spool-{self.port}"),
            ISOGATE_CAPACITY_POLL_INTERVAL_S="0.5",
            ISOGATE_LOG_LEVEL="info",
        )
        env.update(self.env)
        return env

    def start(self, *, wait_ready: bool = True, timeout_s: float = 60.0) -> GatewayProcess:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        if self.root != REPO_ROOT:
            env["PYTHONPATH"] = str(self.root)
        subprocess.run(
            [sys.executable, "-m", "gateway", "migrate"],
            env=env,
            check=True,
            cwd=self.root,
            stdout=subprocess.DEVNULL,
        )
        with open_log_file(self.log_path) as log:
            self.process = subprocess.Popen(
                [
                    *self.command_prefix,
                    *(sys.executable, "-m", "gateway", "serve", "--workers", str(self.workers)),
                ],
                env=env,
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait("/readyz" if wait_ready else "/healthz", timeout_s)
        except BaseException:
            self.stop()  # never leave a gateway behind when it did not come up
            raise
        return self

    def _wait(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # With --workers the processes share the port, and each probe (a connection of its
        # own) reaches one of them: every process started, then several answers in a row,
        # none refused, before all are taken for ready, not the first one's.
        wanted, in_a_row = (1 if self.workers == 1 else 4 * self.workers), 0
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"gateway exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                ok = httpx.get(self.url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            in_a_row = in_a_row + 1 if ok and self._all_started() else 0
            if in_a_row >= wanted:
                return
            time.sleep(0.2 if not ok else 0.02)
        raise RuntimeError(f"gateway not ready at {path} after {timeout_s}s:\n{self.log_tail()}")

    def _all_started(self) -> bool:
        if self.workers == 1:
            return True
        try:
            log = self.log_path.read_bytes()
        except FileNotFoundError:
            return False
        return log.count(b"Application startup complete.") >= self.workers

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # What a process killed outright (a test's SIGKILL) left behind, its body parser's
        # forkserver and resource tracker, is still in the group, with nobody to stop it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- admin helpers ----------------------------------------------------------------------

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10
        )

    def create_tenant(self, tenant_id: str | None = None) -> tuple[str, str]:
        """A new tenant and one API key for it: ``(tenant_id, raw_key)``."""
        tenant_id = tenant_id or "t-" + secrets.token_hex(4)
        with self.admin() as client:
            created = client.post("/admin/tenants", json={"id": tenant_id})
            created.raise_for_status()
            key = client.post(f"/admin/tenants/{tenant_id}/keys", json={})
            key.raise_for_status()
            return tenant_id, key.json()["key"]
