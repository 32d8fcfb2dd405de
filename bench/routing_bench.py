"""Section 1: added latency, throughput and CPU per request of sglang_router, SMG and the gateway
against ``direct``, in front of the same instant backends. Every cell runs
``config.routing_rounds`` times, the targets interleaved in each round so that a noisy
neighbour hits them all; a target's figures are the medians (requests and errors: totals)."""

from __future__ import annotations

import asyncio
import statistics
import time

import orjson

from bench.processes import group_cpu_seconds
from bench.rig import MODEL, Rig
from bench.stream_client import Target, described, run_load
from bench.wrk import run_wrk

PROMPT = "Summarise the following in one line: the gateway checks tenant isolation end to end."


def request_body(stream: bool) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream})


def _measure(rig: Rig, mode: str, concurrency: int, url: str, key: str) -> dict:
    """One run of one target: wrk for whole responses, the stream client for ``ttft``."""
    config = rig.config
    if mode == "ttft":
        auth = (("Authorization", f"Bearer {key}"),)
        target = Target(url + "/v1/completions", request_body(True), auth)
        duration = config.ttft_duration_s
        s = asyncio.run(
            run_load(target, concurrency=concurrency, duration_s=duration, warmup_requests=1)
        ).summary()
        figures = {"requests": s["requests"], "errors": s["non_200"], "rps": s["rps"]}
        return figures | {"p50_ms": s["ttft_p50_ms"], "p99_ms": s["ttft_p99_ms"]}
    body, duration = request_body(mode == "stream"), config.wrk_duration_s
    return run_wrk(
        url + "/v1/completions", body, connections=concurrency, duration_s=duration,
        auth=key, cpus=config.helper_cpus,
    )  # fmt: skip


def _median(runs: list[dict]) -> dict:
    """One target's runs of one cell as one cell: medians, with requests and errors summed."""
    cell = runs[0] | {"requests": sum(r["requests"] for r in runs), "rounds": len(runs)}
    cell["errors"] = sum(r["errors"] for r in runs)
    for key in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request", "cpu_utilisation"):
        present = [r[key] for r in runs if r[key] is not None]
        cell[key] = statistics.median(present) if present else None
    return cell


def run_routing_bench(rig: Rig, log=print) -> list[dict]:
    """Each target's cells: mode, in flight, requests, errors, rps, p50/p99, router CPU. The
    scale-out and granian targets (``rig.scale_out``) run whole responses only."""
    key = rig.gateway_key
    targets = [
        ("direct", rig.direct_url, None, key),
        *((name, router.url, router.pid, key) for name, router in rig.routers.items()),
        ("gateway", rig.gateway_url, rig.gateway_pid, key),
    ]
    every = [*targets, *rig.scale_out]
    for _, url, _, key in every:  # warm every path (connection pools, tokenizer, auth cache)
        for stream in (False, True):
            body = request_body(stream)
            run_wrk(url + "/v1/completions", body, connections=4, duration_s=1, auth=key)
    cells: list[dict] = []
    for mode in ("plain", "stream", "ttft"):
        for concurrency in rig.config.concurrencies:
            measured = every if mode == "plain" else targets
            runs: dict[str, list[dict]] = {target[0]: [] for target in measured}
            for _ in range(rig.config.routing_rounds):
                for name, url, pgid, key in measured:
                    cpu_before = group_cpu_seconds(pgid) if pgid else 0.0
                    wall_before = time.perf_counter()
                    cell = {"target": name, "mode": mode, "concurrency": concurrency}
                    cell |= _measure(rig, mode, concurrency, url, key)
                    cell["cpu_us_per_request"] = cell["cpu_utilisation"] = None
                    if pgid:
                        wall = time.perf_counter() - wall_before
                        cpu = group_cpu_seconds(pgid) - cpu_before
                        cell["cpu_utilisation"] = cpu / wall
                        if cell["requests"]:
                            cell["cpu_us_per_request"] = cpu / cell["requests"] * 1e6
                    runs[name].append(cell)
                    log("  " + described(cell))
            cells += [_median(runs[name]) for name in runs]
    return cells
