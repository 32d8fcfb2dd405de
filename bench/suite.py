"""``make bench``: the whole benchmark suite in one run, one results table.

    .venv/bin/python -m bench.suite          # full (~12 min); BENCH_QUICK=1: ~2-3 min smoke run

Environment: BENCH_QUICK, BENCH_DURATION_S (seconds per wrk cell), BENCH_ROUNDS (runs per
section-1 cell), BENCH_PIN (default on),
BENCH_PRIORITY (autogroup nice of the bench's processes, e.g. -10 on a busy shared machine),
BENCH_REAL_ENGINE (default on in a full run), BENCH_REAL_REQUESTS, BENCH_SERVING (0: no
sglang.bench_serving in the real section), BENCH_SERVING_PROMPTS, BENCH_SERVING_RATE, BENCH_PEERS,
BENCH_AUDIT_ROWS, BENCH_SECTIONS (comma list of routing,memory,prompt,peers,real,fair,hostile;
default all), BENCH_FAIR_SECONDS, BENCH_FAIR_CAP (bench/fair_share_bench.py),
BENCH_GATEWAY_ROOT (run a patched copy of the gateway). Writes ``bench/results/latest.md`` and
``latest.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.config import BenchConfig
from bench.fair_share_bench import run_fair_share_bench
from bench.hostile_bench import run_hostile_bench
from bench.machine import describe_machine, load_average
from bench.memory_bench import memory_as_json, run_memory_bench
from bench.peer_benches import run_peer_benches
from bench.processes import boost, rss_bytes
from bench.prompt_bench import run_prompt_bench
from bench.real_engine_bench import run_real_engine_bench
from bench.report import render
from bench.rig import instant_rig
from bench.routing_bench import cells_as_json, request_body, run_routing_bench
from bench.wrk import wrk_available

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(message, flush=True)


def _section(name: str, results: dict, errors: list[str], run) -> None:
    log(f"== {name}")
    try:
        run()
    except Exception as exc:  # one failed section still leaves the others' numbers
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())


def main() -> int:
    if not wrk_available():
        print(
            "bench: wrk is missing (scripts/bench installs it: apt-get install -y wrk)",
            file=sys.stderr,
        )
        return 2
    config = BenchConfig.from_env()
    machine = describe_machine()  # before pinning this process, so it sees every CPU
    if config.helper_cpus:
        os.sched_setaffinity(0, config.helper_cpus)
    boost(os.getpid(), config.priority)
    started = time.monotonic()
    pinning = (
        f"sglang_router, SMG and the gateway each on CPU {sorted(config.router_cpus)} "
        "(one core, one at a time under load); instant backends, wrk (1 thread) and the runner "
        f"on CPUs {sorted(config.helper_cpus)}"
        if config.router_cpus
        else "none (fewer than 2 CPUs, or BENCH_PIN=0)"
    )
    if config.priority:
        pinning += f"; bench processes at autogroup nice {config.priority}"
    if config.gateway_root:
        pinning += f"; GATEWAY RUN FROM A PATCHED COPY at {config.gateway_root}"
    results: dict = {
        "started_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {
            "quick": config.quick,
            "pinning": pinning,
            "wrk_duration_s": config.wrk_duration_s,
            "routing_rounds": config.routing_rounds,
            "priority": config.priority,
            "sections": sorted(config.sections),
        },
        "machine": machine,
    }
    errors: list[str] = []
    for key, value in results["machine"].items():
        log(f"{key:>32}: {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="isogate-bench-"))
    try:
        if config.sections & {"routing", "memory", "prompt"}:
            with instant_rig(config, work) as rig:
                httpx.post(
                    rig.gateway_url + "/v1/completions",
                    content=request_body(False),
                    timeout=30,
                    headers={
                        "Authorization": f"Bearer {rig.gateway_key}",
                        "Content-Type": "application/json",
                    },
                )
                idle_fresh_mb = rss_bytes(rig.gateway_pid) / 1e6
                if config.runs("routing"):
                    _section(
                        "1. routing cost on an instant backend",
                        results,
                        errors,
                        lambda: results.__setitem__(
                            "routing", cells_as_json(run_routing_bench(rig, log))
                        ),
                    )
                # Memory before the prompt section: a 1M-token prompt grows the heap for good.
                if config.runs("memory"):
                    _section(
                        "4. gateway memory",
                        results,
                        errors,
                        lambda: results.__setitem__(
                            "memory", memory_as_json(run_memory_bench(rig, idle_fresh_mb, log))
                        ),
                    )
                if config.runs("prompt"):
                    _section(
                        "2. tokenization, admission, refusal, blocking",
                        results,
                        errors,
                        lambda: results.__setitem__("prompt", run_prompt_bench(rig, log)),
                    )
    except Exception as exc:
        errors.append(f"instant-backend rig: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    if config.runs("hostile"):
        _section(
            "hostile clients on an instant backend",
            results,
            errors,
            lambda: results.__setitem__(
                "hostile", run_hostile_bench(config, work / "hostile", log)
            ),
        )
    if config.peer_benches and config.runs("peers"):
        _section(
            "3. other benches",
            results,
            errors,
            lambda: results.__setitem__("peers", run_peer_benches(config, log)),
        )
    if config.runs("real"):
        _section(
            "real SGLang PD pair",
            results,
            errors,
            lambda: results.__setitem__("real_engine", run_real_engine_bench(config, work, log)),
        )
    if config.runs("fair") and config.real_engine:
        _section(
            "fair share on a real SGLang PD pair",
            results,
            errors,
            lambda: results.__setitem__("fair_share", run_fair_share_bench(config, work, log)),
        )
    results["machine"]["load average at end"] = load_average()
    results["seconds"] = time.monotonic() - started
    results["errors"] = errors
    markdown = render(results)
    (RESULTS / "latest.md").write_text(markdown)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n" + markdown)
    log(f"written: {RESULTS / 'latest.md'} and latest.json ({results['seconds']:.0f} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
