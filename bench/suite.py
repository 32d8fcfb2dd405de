"""``make bench``: every section in one run, one report (``bench/results/latest.md``, ``.json``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.config import BenchConfig
from bench.fair_share_bench import run_fair_share_bench
from bench.hostile_bench import run_hostile_bench
from bench.machine import describe_machine, load_average
from bench.memory_bench import run_memory_bench
from bench.peer_benches import run_peer_benches
from bench.processes import boost, rss_bytes
from bench.prompt_bench import run_prompt_bench
from bench.real_engine_bench import run_real_engine_bench
from bench.report import render
from bench.rig import instant_rig
from bench.routing_bench import request_body, run_routing_bench

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(message, flush=True)


def main() -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("bench: wrk is missing (scripts/bench installs it: apt-get install wrk)")
    config = BenchConfig.from_env()
    machine = describe_machine()  # before pinning this process, so it sees every CPU
    if config.helper_cpus:
        os.sched_setaffinity(0, config.helper_cpus)
    boost(os.getpid(), config.priority)
    started = time.monotonic()
    pinning = (
        f"sglang_router, SMG and the gateway each on CPU {sorted(config.router_cpus)} (one core, "
        f"one at a time under load); instant backends, wrk (1 thread) and the runner on CPUs "
        f"{sorted(config.helper_cpus or ())}"
        if config.router_cpus
        else "none (fewer than 2 CPUs, or BENCH_PIN=0)"
    )
    if config.priority:
        pinning += f"; bench processes at autogroup nice {config.priority}"
    if config.gateway_root:
        pinning += f"; GATEWAY RUN FROM A PATCHED COPY at {config.gateway_root}"
    config_summary = {
        "quick": config.quick, "pinning": pinning, "wrk_duration_s": config.wrk_duration_s,
        "routing_rounds": config.routing_rounds, "priority": config.priority,
        "sections": sorted(config.sections),
    }  # fmt: skip
    results: dict[str, Any] = {
        "started_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "config": config_summary,
        "machine": machine,
    }
    errors: list[str] = []
    for key, value in machine.items():
        log(f"{key:>32}: {value}")

    def section(key: str, run: Callable[[], Any]) -> None:
        log(f"== {key}")
        try:
            results[key] = run()
        except Exception as exc:  # one failed section still leaves the others' numbers
            errors.append(f"{key}: {type(exc).__name__}: {exc}")
            log(traceback.format_exc())

    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="isogate-bench-"))
    try:
        if config.sections & {"routing", "memory", "prompt"}:
            with instant_rig(config, work) as rig:
                headers = {
                    "Authorization": f"Bearer {rig.gateway_key}",
                    "Content-Type": "application/json",
                }
                url = rig.gateway_url + "/v1/completions"
                httpx.post(url, content=request_body(False), headers=headers, timeout=30)
                idle_fresh_mb = rss_bytes(rig.gateway_pid) / 1e6
                if config.runs("routing"):
                    section("routing", lambda: run_routing_bench(rig, log))
                # Memory before the prompt section: a 1M-token prompt grows the heap for good.
                if config.runs("memory"):
                    section("memory", lambda: run_memory_bench(rig, idle_fresh_mb, log))
                if config.runs("prompt"):
                    section("prompt", lambda: run_prompt_bench(rig, log))
    except Exception as exc:
        errors.append(f"instant-backend rig: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    if config.runs("hostile"):
        section("hostile", lambda: run_hostile_bench(config, work / "hostile", log))
    if config.peer_benches and config.runs("peers"):
        section("peers", lambda: run_peer_benches(config, log))
    # The engine sections run as deployed: the PD pair, the routers, the gateways and their
    # clients on every CPU. A child inherits the runner's pinning to the helper CPUs, so the
    # runner lets it go first (before, every process of these sections shared one core).
    os.sched_setaffinity(0, config.all_cpus)
    if config.runs("real"):
        section("real_engine", lambda: run_real_engine_bench(config, work, log))
    if config.runs("fair") and config.real_engine:
        section("fair_share", lambda: run_fair_share_bench(config, work, log))
    machine["load average at end"] = load_average()
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
