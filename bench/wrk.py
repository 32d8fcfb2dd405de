"""Run ``wrk`` (section 1's load generator) with ``wrk_post.lua`` and read its numbers."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import orjson

LUA = Path(__file__).resolve().parent / "wrk_post.lua"


def run_wrk(
    url: str, body: bytes, *, connections: int, duration_s: float, auth: str | None = None,
    cpus: set[int] | None = None, timeout_s: float = 10.0,
) -> dict[str, float]:  # fmt: skip
    """``connections`` keep-alive connections in closed loop for ``duration_s``, one wrk thread:
    requests, errors (connect, read, write, timeout and non-2xx), rps, p50_ms, p99_ms."""
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        body_file.write(body)
        body_file.flush()
        options = f"-t 1 -c {connections} -d {max(1, round(duration_s))}s"
        command = ["wrk", *options.split(), "--timeout", f"{max(1, round(timeout_s))}s"]
        process = subprocess.Popen(
            [*command, "-s", str(LUA), url],
            env=dict(os.environ, WRK_BODY_FILE=body_file.name, WRK_AUTH=auth or ""),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        stdout, stderr = process.communicate(timeout=duration_s + timeout_s + 30)
    line = next((ln for ln in stdout.decode().splitlines() if ln.startswith("WRK_JSON ")), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk failed ({process.returncode}): {stderr[-500:]!r} {stdout[-500:]!r}"
        )
    raw = orjson.loads(line.removeprefix("WRK_JSON "))
    seconds, requests = raw["duration_us"] / 1e6, raw["requests"]
    rps = requests / seconds if seconds else 0.0
    return {
        "requests": requests, "errors": raw["errors"], "rps": rps,
        "p50_ms": raw["p50_us"] / 1000, "p99_ms": raw["p99_us"] / 1000,
    }  # fmt: skip
