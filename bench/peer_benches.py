"""Section 3: the benches other parts of the project own, run from here when they are present.

- ``bench/audit_bench.py``: audit insert throughput (SQLite, PostgreSQL) and query time.
- ``bench/verify_bench.py``: verification and canary scanning cost per request and per KB.
- ``bench/engine_patch_costs.py`` in the engine venv: the SGLang plugin's cost.
- ``bench/python_floor.py``: what a bare Python PD proxy on the gateway's stack costs per
  request (the floor under the gateway's own work).
- ``bench/pipeline_costs.py``: what each step of the request path costs, by taking it out
  (in process, A/B alternating).

Each runs as its own process (so its imports and memory stay out of this one) with a time
limit; what it printed and the JSON it wrote are kept as they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import ENGINE_PYTHON, REPO_ROOT

RESULTS = Path(__file__).resolve().parent / "results"
COSTS_SNIPPET = (
    "import json; from bench.engine_patch_costs import measure_costs; "
    "print('COSTS_JSON ' + json.dumps(measure_costs(), default=str))"
)


@dataclass
class PeerRun:
    name: str
    command: list[str]
    status: str  # ok | failed (rc) | timed out | absent
    seconds: float
    output_tail: str
    results: object | None


def _run(name: str, command: list[str], timeout_s: float, results_file: Path | None) -> PeerRun:
    if results_file is not None and results_file.exists():
        results_file.unlink()  # never report a previous run's numbers as this one's
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s
        )
        status = "ok" if done.returncode == 0 else f"failed (rc {done.returncode})"
        output = (done.stdout + ("\n" + done.stderr if done.returncode else "")).strip()
    except subprocess.TimeoutExpired as expired:
        status, output = f"timed out after {timeout_s:.0f} s", str(expired.stdout or "")
    seconds = time.monotonic() - started
    results: object | None = None
    if results_file is not None and results_file.exists():
        results = json.loads(results_file.read_text())
    for line in output.splitlines():
        if line.startswith("COSTS_JSON "):
            results = json.loads(line[len("COSTS_JSON ") :])
    return PeerRun(name, command, status, seconds, output[-3000:], results)


def run_peer_benches(config: BenchConfig, log=print) -> list[dict]:
    python = sys.executable
    runs: list[PeerRun] = []
    if (REPO_ROOT / "bench" / "audit_bench.py").exists():
        args = ["--rows", str(config.audit_rows)]
        if config.quick:
            args += ["--insert-events", "10000", "--queries", "100"]
        runs.append(
            _run("audit", [python, "-m", "bench.audit_bench", *args], 420, RESULTS / "audit.json")
        )
    else:
        runs.append(
            PeerRun("audit", [], "absent", 0.0, "bench/audit_bench.py is not there yet", None)
        )
    if (REPO_ROOT / "bench" / "verify_bench.py").exists():
        args = ["--quick"] if config.quick else []
        runs.append(
            _run(
                "verify", [python, "-m", "bench.verify_bench", *args], 300, RESULTS / "verify.json"
            )
        )
    else:
        runs.append(
            PeerRun("verify", [], "absent", 0.0, "bench/verify_bench.py is not there yet", None)
        )
    if (REPO_ROOT / "bench" / "engine_patch_costs.py").exists() and ENGINE_PYTHON.exists():
        runs.append(_run("engine_patch", [str(ENGINE_PYTHON), "-c", COSTS_SNIPPET], 300, None))
    else:
        runs.append(
            PeerRun(
                "engine_patch",
                [],
                "absent",
                0.0,
                "bench/engine_patch_costs.py is not there yet",
                None,
            )
        )
    seconds = str(2 if config.quick else 6)
    runs.append(
        _run(
            "python_floor",
            [
                python,
                "-m",
                "bench.python_floor",
                "--seconds",
                seconds,
                "--out",
                str(RESULTS / "python_floor.json"),
            ],
            180,
            RESULTS / "python_floor.json",
        )
    )
    rounds = str(2 if config.quick else 10)
    runs.append(
        _run(
            "pipeline_costs",
            [
                python,
                "-m",
                "bench.pipeline_costs",
                "--rounds",
                rounds,
                "--out",
                str(RESULTS / "pipeline_costs.json"),
            ],
            300,
            RESULTS / "pipeline_costs.json",
        )
    )
    for run in runs:
        log(f"  {run.name}: {run.status} in {run.seconds:.0f} s")
    return [asdict(r) for r in runs]
