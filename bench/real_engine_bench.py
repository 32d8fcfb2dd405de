"""The same comparison on real SGLang 0.5.23 CPU workers: one PD pair of the tiny model.

Small n: a request takes ~0.1-0.5 s of model time on the CPU, which dwarfs any router, so
this run shows that the three paths agree and what the routers add on top of a real engine,
not their cost (the instant-backend section measures that). Direct = the client sends the
same ``/v1/completions`` body with bootstrap fields to prefill and decode at once, as a
router does, with one ``rid`` for both. sglang_router 0.3.2 does not give the two halves a
common rid, and engine_patch (which, without the gateway's tags, binds prefill and decode by
rid) refuses such a pair as ``foreign_generation``; so the client gives each request to the
router its own ``rid``, which the router forwards to both. Nothing is pinned here: the workers
need both cores. The pair is started only when at least 7 GiB are available, and always
stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from bench.config import BenchConfig
from bench.processes import (
    free_ports,
    peers_in_front,
)
from bench.routing_bench import PROMPT
from bench.serving_bench import ServingTarget, run_serving_bench_from_env
from bench.stream_client import RunResult, Target, run_load, run_pd_direct
from gateway.dev.cluster import ClusterStartError, PDCluster, default_cluster_spec

MIN_AVAILABLE_GIB = 7.0
MODEL = "tiny-llama"
MAX_TOKENS = 8


@dataclass
class RealCell:
    target: str
    mode: str  # plain | stream
    concurrency: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None
    rps: float


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


def _cell(name: str, mode: str, concurrency: int, result: RunResult) -> RealCell:
    s = result.summary()
    return RealCell(
        name,
        mode,
        concurrency,
        int(s["requests"]),
        int(s["non_200"]),
        s["total_p50_ms"],
        s["total_p99_ms"],
        s["ttft_p50_ms"] if mode == "stream" else None,
        s["rps"],
    )


def run_real_engine_bench(config: BenchConfig, work_dir: Path, log=print) -> dict:
    if not config.real_engine:
        return {"skipped": "BENCH_REAL_ENGINE=0"}
    free = available_gib()
    if free < MIN_AVAILABLE_GIB:
        return {
            "skipped": (
                f"only {free:.1f} GiB available (< {MIN_AVAILABLE_GIB} GiB needed for a PD pair)"
            )
        }
    ports = config.ports
    spec = default_cluster_spec(
        prefill_port=free_ports(ports.real_prefill),
        decode_port=free_ports(ports.real_decode),
        bootstrap_port=free_ports(ports.real_bootstrap),
        log_dir=work_dir / "sglang",
    )
    cluster = PDCluster(spec)
    peers = contextlib.ExitStack()
    started = time.monotonic()
    try:
        try:
            cluster.start()
        except ClusterStartError as exc:
            # Our ports lie inside the kernel's ephemeral range; one retry after a port clash.
            if "address already in use" not in str(exc).lower():
                raise
            log("  a port was taken for a moment; starting the PD pair again")
            time.sleep(5)
            cluster.start()
        log(f"  PD pair ready in {time.monotonic() - started:.0f} s")
        router, gateway, key, tags = peers.enter_context(
            peers_in_front(
                cluster,
                work_dir,
                router_port=ports.real_router,
                gateway_port=ports.real_gateway,
                model=MODEL,
            )
        )
        cells = []
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}
            raw = orjson.dumps(body)
            auth = (("Authorization", f"Bearer {key}"),)
            for concurrency, total in ((1, config.real_requests), (4, config.real_requests * 2)):
                runs = {
                    "direct": run_pd_direct(
                        cluster.prefill_url,
                        cluster.decode_url,
                        cluster.bootstrap_port,
                        body,
                        concurrency=concurrency,
                        total_requests=total,
                    ),
                    "sglang_router": run_load(
                        Target(
                            f"http://127.0.0.1:{router.port}/v1/completions", raw, fresh_rid=True
                        ),
                        concurrency=concurrency,
                        total_requests=total,
                        warmup_requests=1,
                    ),
                    "gateway": run_load(
                        Target(gateway.url + "/v1/completions", raw, auth),
                        concurrency=concurrency,
                        total_requests=total,
                        warmup_requests=1,
                    ),
                }
                for name, run in runs.items():
                    cell = _cell(name, mode, concurrency, asyncio.run(run))
                    cells.append(cell)
                    log(
                        f"  real {mode:6} c={concurrency} {name:14} n={cell.requests:<3} "
                        f"p50 {cell.p50_ms:7.1f} ms  p99 {cell.p99_ms:7.1f} ms"
                        + (f"  ttft p50 {cell.ttft_p50_ms:7.1f} ms" if stream else "")
                        + f"  errors {cell.errors}"
                    )
        # SGLang's own bench_serving (both OpenAI backends) on the same pair, router, gateway.
        serving = run_serving_bench_from_env(
            [
                ServingTarget("sglang_router", f"http://127.0.0.1:{router.port}"),
                ServingTarget("gateway", gateway.url, key),
            ],
            worker_urls=(cluster.prefill_url, cluster.decode_url),
            model_dir=spec.model_dir,
            work_dir=work_dir / "bench-serving",
            priority=config.priority,
            log=log,
        )
        return {
            "engine_tags": tags,
            "cells": [asdict(c) for c in cells],
            "serving": serving,
            "startup_s": time.monotonic() - started,
        }
    except Exception as exc:  # report, never leave the pair running
        log(f"  real-engine run failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    finally:
        peers.close()
        cluster.stop()
