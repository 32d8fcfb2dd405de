"""Throwaway Redis and PostgreSQL servers of a test's own, so a test may restart them.

The machine's shared Redis (6379) and PostgreSQL (5432) belong to everyone and are never
touched. These run on ports of this suite's range, in a temporary directory, and are
stopped (and their data removed) on the way out.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import redis

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class RedisServer:
    def __init__(self, port: int, work_dir: Path) -> None:
        self.port = port
        self.work_dir = work_dir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.work_dir / f"redis-{self.port}.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.work_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: the crash case (an orderly shutdown is the easy one)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class PostgresCluster:
    """``initdb`` + ``pg_ctl`` as the postgres user, in a temporary directory, on our own port."""

    def __init__(self, port: int) -> None:
        self.port = port
        # Not under pytest's tmp_path: that is root's, mode 700, and the server runs as postgres.
        self.base_dir = Path(tempfile.mkdtemp(prefix=f"isogate-pg-{port}-"))
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *command: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *command],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=120,
        )

    def init(self) -> PostgresCluster:
        shutil.chown(self.base_dir, "postgres")
        self._as_postgres(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data_dir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        )
        return self

    def start(self) -> None:
        self._as_postgres(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-w",
            "-o",
            f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(
                    f"postgresql://postgres@127.0.0.1:{self.port}/postgres", connect_timeout=2
                ).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: no shutdown checkpoint, open connections cut, like a crash."""
        if (self.data_dir / "postmaster.pid").exists():
            self._as_postgres(
                str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"
            )

    def __enter__(self) -> PostgresCluster:
        self.init()
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
