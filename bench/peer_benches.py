"""Section 3: the audit log (``audit_bench``: SQLite, then PostgreSQL), verification and canary
scanning (``verify_bench``) and the SGLang plugin's hooks (``engine_patch_costs``, run in the
engine venv, which has SGLang). A failed bench is reported beside the others' figures."""

from __future__ import annotations

import json
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.audit_bench import DEFAULT_POSTGRES_URL, run_audit_bench
from bench.config import BenchConfig
from bench.processes import ENGINE_PYTHON, REPO_ROOT
from bench.verify_bench import run as run_verify_bench

COSTS_SNIPPET = (
    "import json; from bench.engine_patch_costs import measure_costs as m; print(json.dumps(m()))"
)


def _engine_patch_costs() -> Any:
    command = [str(ENGINE_PYTHON), "-c", COSTS_SNIPPET]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"rc {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run_peer_benches(config: BenchConfig, log=print) -> list[dict]:
    audit: dict[str, Any] = {"total_rows": config.audit_rows}
    if config.quick:
        audit |= {"insert_events": 10_000, "queries": 100}
    benches: dict[str, Callable[[], Any]] = {
        "audit": lambda: [
            run_audit_bench(url, **audit) for url in ("sqlite://", DEFAULT_POSTGRES_URL)
        ],
        "verify": lambda: run_verify_bench(config.quick),
        "engine_patch": _engine_patch_costs,
    }
    runs = []
    for name, bench in benches.items():
        started, results, output = time.monotonic(), None, ""
        try:
            results, status = bench(), "ok"
        except Exception as exc:
            status, output = f"failed: {type(exc).__name__}", traceback.format_exc()[-3000:]
        run = {"name": name, "status": status, "seconds": time.monotonic() - started}
        runs.append(run | {"results": results, "output_tail": output})
        log(f"  {name}: {status} in {run['seconds']:.0f} s")
    return runs
