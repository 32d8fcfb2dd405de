"""The machine and software a bench ran on, for the results header."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from bench.processes import ENGINE_PYTHON, REPO_ROOT, SMG_BINARY


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _run(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
        return (out.stdout or out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def describe_machine() -> dict[str, str]:
    engine_versions = _run(
        [
            str(ENGINE_PYTHON),
            "-c",
            "from importlib.metadata import version as v; "
            "print(v('sglang-router'), v('sglang'), v('torch'))",
        ]
    ).split()
    wrk = _run(["wrk", "-v"]).splitlines()
    smg = (
        _run(
            [
                str(SMG_BINARY.with_name("python")),
                "-c",
                "from importlib.metadata import version; print(version('smg'))",
            ]
        )
        if SMG_BINARY.exists()
        else "not installed (section 1 runs without it)"
    )
    return {
        "cpu": _cpu_model(),
        "cpus": f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable)",
        "memory": f"{_mem_total_gib():.1f} GiB",
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "gateway stack": ", ".join(
            f"{p} {_version(p)}"
            for p in (
                "uvicorn",
                "starlette",
                "httpx",
                "httptools",
                "uvloop",
                "tokenizers",
                "orjson",
            )
        ),
        "sglang_router": engine_versions[0] if len(engine_versions) == 3 else "unavailable",
        "smg": smg,
        "sglang / torch (real-engine run)": " / ".join(engine_versions[1:])
        if len(engine_versions) == 3
        else "unavailable",
        "wrk": wrk[0] if wrk else "unavailable",
        "git commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "load average at start": load_average(),
    }
