"""Run ``wrk`` (the routing bench's load generator) with ``wrk_post.lua`` and read its numbers."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

LUA = Path(__file__).resolve().parent / "wrk_post.lua"


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    errors: int  # connect/read/write/timeout errors plus non-2xx answers
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(
    url: str,
    body: bytes,
    *,
    connections: int,
    duration_s: float,
    auth: str | None = None,
    threads: int = 1,
    cpus: set[int] | None = None,
    timeout_s: float = 10.0,
) -> WrkResult:
    """``connections`` keep-alive connections in closed loop for ``duration_s`` (one wrk thread
    by default)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        body_file.write(body)
        body_file.flush()
        env = dict(os.environ, WRK_BODY_FILE=body_file.name, WRK_AUTH=auth or "")
        command = [
            "wrk",
            "-t",
            str(min(threads, connections)),
            "-c",
            str(connections),
            "-d",
            f"{max(1, round(duration_s))}s",
            "--timeout",
            f"{max(1, round(timeout_s))}s",
            "-s",
            str(LUA),
            url,
        ]
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        stdout, stderr = process.communicate(timeout=duration_s + timeout_s + 30)
    line = next((ln for ln in stdout.decode().splitlines() if ln.startswith("WRK_JSON ")), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk failed ({process.returncode}): {stderr.decode()[-500:]} {stdout.decode()[-500:]}"
        )
    raw = orjson.loads(line[len("WRK_JSON ") :])
    errors = sum(
        raw[k]
        for k in (
            "errors_connect",
            "errors_read",
            "errors_write",
            "errors_status",
            "errors_timeout",
        )
    )
    return WrkResult(
        requests=raw["requests"],
        duration_s=raw["duration_us"] / 1e6,
        errors=errors,
        p50_ms=raw["p50_us"] / 1000,
        p90_ms=raw["p90_us"] / 1000,
        p99_ms=raw["p99_us"] / 1000,
        mean_ms=raw["mean_us"] / 1000,
    )
