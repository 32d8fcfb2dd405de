"""Section 1's comparison on a real SGLang 0.5.23 CPU PD pair of the tiny model: model time
dwarfs any router, so this shows the paths agree, not their cost; streamed, it shows how each
delivers the tokens, gap by gap. sglang_router 0.3.2 gives the two halves no common rid, which
engine_patch refuses without the gateway's tags, so each request to a peer carries its own
``rid``. Nothing pinned; started only with 7 GiB free."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from bench import processes as procs
from bench.config import BenchConfig
from bench.processes import SMG_BINARY, BenchModel, BenchPool, free_ports, pd_router, start_gateway
from bench.routing_bench import PROMPT
from bench.serving_bench import ServingTarget, run_serving_bench
from bench.stream_client import Target, described, run_load, run_pd_direct
from gateway.dev.cluster import ClusterStartError, PDCluster, default_cluster_spec
from gateway.workers.capacity import ENGINE_PATCH_MARKER

MIN_AVAILABLE_GIB = 7.0
MODEL = "tiny-llama"
MAX_TOKENS = 8
# Streamed cells: enough tokens (never cut short by an end of sequence) that a request's gaps
# between tokens show the decode step, and a router that holds a stream's start back.
STREAM_TOKENS = 48


def too_little_memory() -> str | None:
    """Why a real PD pair must not be started here, if so."""
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in ln)
    free = int(line.split()[1]) / 1024 / 1024
    if free < MIN_AVAILABLE_GIB:
        return f"only {free:.1f} GiB available (< {MIN_AVAILABLE_GIB} GiB needed for a PD pair)"
    return None


@contextlib.contextmanager
def real_pair(config: BenchConfig, log_dir: Path, log=print) -> Iterator[PDCluster]:
    """A real PD pair of the tiny model, started, and always stopped."""
    ports, started = config.ports, time.monotonic()
    cluster = PDCluster(default_cluster_spec(
        prefill_port=free_ports(ports.real_prefill), decode_port=free_ports(ports.real_decode),
        bootstrap_port=free_ports(ports.real_bootstrap), log_dir=log_dir,
    ))  # fmt: skip
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
        yield cluster
    finally:
        cluster.stop()


def pair_policies(cluster: PDCluster, directory: Path) -> tuple[Path, bool]:
    """Policies for the pair behind ``MODEL``, and whether the pair runs engine_patch."""
    info = httpx.get(f"{cluster.decode_url}/server_info", timeout=10).json()
    tags = bool(info.get(ENGINE_PATCH_MARKER))
    pool = BenchPool(cluster.prefill_url, cluster.bootstrap_port, cluster.decode_url)
    model = BenchModel(MODEL, cluster.spec.prefill.max_total_tokens, pool, tags)
    tokenizer = cluster.spec.model_dir
    return procs.write_bench_policies(directory, tokenizer_dir=tokenizer, models=[model]), tags


def run_real_engine_bench(config: BenchConfig, work_dir: Path, log=print) -> dict:
    if not config.real_engine:
        return {"skipped": "BENCH_REAL_ENGINE=0"}
    if why := too_little_memory():
        return {"skipped": why}
    started, ports = time.monotonic(), config.ports
    try:
        with real_pair(config, work_dir / "sglang", log) as cluster, contextlib.ExitStack() as up:
            policies, tags = pair_policies(cluster, work_dir / "real-policies")
            pool = BenchPool(cluster.prefill_url, cluster.bootstrap_port, cluster.decode_url)
            router = pd_router("sglang-router", pool, ports.real_router, work_dir, cpus=None)
            up.callback(router.stop)
            targets = [ServingTarget("sglang_router", router.url)]
            if SMG_BINARY.exists():  # its port pair after sglang_router's
                smg = pd_router("smg", pool, router.port + 2, work_dir, cpus=None, models=[MODEL])
                up.callback(smg.stop)
                targets.append(ServingTarget("smg", smg.url))
            gateway_dir = work_dir / "real-gateway"
            gateway, key = start_gateway(policies, gateway_dir, ports.real_gateway, cpus=None)
            up.callback(gateway.stop)
            targets.append(ServingTarget("gateway", gateway.url, key))
            cells = _cells(config, cluster, targets, log)
            serving = run_serving_bench(
                targets, worker_urls=(cluster.prefill_url, cluster.decode_url),
                model_dir=cluster.spec.model_dir, work_dir=work_dir / "bench-serving",
                priority=config.priority, log=log,
            )  # fmt: skip
            took = time.monotonic() - started
            return {"engine_tags": tags, "cells": cells, "serving": serving, "startup_s": took}
    except Exception as exc:  # reported; the pair and the peers are stopped on the way out
        log(f"  real-engine run failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def _cells(
    config: BenchConfig, cluster: PDCluster, routers: list[ServingTarget], log
) -> list[dict]:
    """Direct and each router, plain and streamed, at 1 and 4 in flight; streamed cells also
    time the gaps between tokens as the client receives them."""
    cells = []
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}
        if stream:
            body |= {"max_tokens": STREAM_TOKENS, "ignore_eos": True}
        raw = orjson.dumps(body)
        for n, total in ((1, config.real_requests), (4, config.real_requests * 2)):
            pair = (cluster.prefill_url, cluster.decode_url, cluster.bootstrap_port, body)
            load = {"concurrency": n, "total_requests": total}
            runs = {"direct": run_pd_direct(*pair, **load, token_gaps=stream)}
            for router in routers:
                auth = (("Authorization", f"Bearer {router.api_key}"),) if router.api_key else ()
                # A peer sends no tags: engine_patch binds the two halves by one rid instead.
                url, peer = router.base_url + "/v1/completions", router.name != "gateway"
                target = Target(url, raw, auth, fresh_rid=peer, token_gaps=stream)
                runs[router.name] = run_load(target, **load, warmup_requests=1)
            for name, run in runs.items():
                s = asyncio.run(run).summary()
                cell = {"target": name, "mode": "stream" if stream else "plain", "concurrency": n}
                cell |= {"requests": s["requests"], "errors": s["non_200"], "rps": s["rps"]}
                cell |= {"p50_ms": s["total_p50_ms"], "p99_ms": s["total_p99_ms"]}
                cell["ttft_p50_ms"] = s["ttft_p50_ms"] if stream else None
                for figure in ("gap_p50_ms", "gap_mean_ms", "gaps_together_pct"):
                    cell[figure] = s.get(figure)
                cells.append(cell)
                log("  " + described(cells[-1]))
    return cells
