"""The machine and software a bench ran on, for the report's header."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from bench.processes import ENGINE_PYTHON, REPO_ROOT, SMG_BINARY

STACK = ("uvicorn", "starlette", "httpx", "httptools", "uvloop", "tokenizers", "orjson")
VERSIONS = "from importlib.metadata import version as v; print(*(v(p) for p in {!r}))"


def _proc_line(path: str, prefix: str) -> str:
    line = next((ln for ln in Path(path).read_text().splitlines() if ln.startswith(prefix)), "")
    return line.split(":", 1)[1].strip() if line else "unknown"


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
    engine = _run([str(ENGINE_PYTHON), "-c", VERSIONS.format(("sglang-router", "sglang", "torch"))])
    engine_versions = engine.split() if len(engine.split()) == 3 else ["unavailable"] * 3
    smg = "not installed (section 1 runs without it)"
    if SMG_BINARY.exists():
        smg = _run([str(SMG_BINARY.with_name("python")), "-c", VERSIONS.format(("smg",))])
    memory_kib = int(_proc_line("/proc/meminfo", "MemTotal:").split()[0])
    return {
        "cpu": _proc_line("/proc/cpuinfo", "model name"),
        "cpus": f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable)",
        "memory": f"{memory_kib / 1024 / 1024:.1f} GiB",
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "gateway stack": ", ".join(f"{p} {_version(p)}" for p in STACK),
        "sglang_router": engine_versions[0],
        "smg": smg,
        "sglang / torch (real-engine run)": " / ".join(engine_versions[1:]),
        "wrk": (_run(["wrk", "-v"]).splitlines() or ["unavailable"])[0],
        "git commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "load average at start": load_average(),
    }
