"""Section 1: added latency and throughput of sglang_router, SMG and the gateway, against direct.

All get the same client request (``POST /v1/completions``, a short prompt, 4 output tokens) in
front of the same instant backends: ``direct`` sends it straight to the decode backend (one
hop, the floor); ``sglang_router``, SMG (where ``.venv-smg`` is installed) and the gateway
forward it to prefill and decode. ``wrk`` times whole responses (non-streaming, and streams of
4 chunks sent back to back); ``bench.stream_client`` times the first body bytes of a stream
(TTFT). Every cell runs ``config.routing_rounds`` times, the targets interleaved in each round
so that a noisy neighbour hits them all; a target's figures are the medians over the rounds
(requests and errors: totals).

CPU per request is the router process group's CPU time over the run divided by the requests it
served: at saturation the cost figure that does not depend on where the bottleneck is.
"""

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


def _measure(rig: Rig, mode: str, concurrency: int, url: str) -> dict:
    """One run of one target: wrk for whole responses (``plain``, ``stream``), the stream
    client for the first body bytes (``ttft``)."""
    config = rig.config
    if mode == "ttft":
        auth = (("Authorization", f"Bearer {rig.gateway_key}"),)
        target = Target(url + "/v1/completions", request_body(True), auth)
        load = run_load(
            target, concurrency=concurrency, duration_s=config.ttft_duration_s, warmup_requests=1
        )
        s = asyncio.run(load).summary()
        figures = {"requests": s["requests"], "errors": s["non_200"], "rps": s["rps"]}
        return figures | {"p50_ms": s["ttft_p50_ms"], "p99_ms": s["ttft_p99_ms"]}
    return run_wrk(
        url + "/v1/completions",
        request_body(mode == "stream"),
        connections=concurrency,
        duration_s=config.wrk_duration_s,
        auth=rig.gateway_key,
        cpus=config.helper_cpus,
    )


def _median(runs: list[dict]) -> dict:
    """One target's runs of one cell as one cell: medians, with requests and errors summed."""
    cell = runs[0] | {"requests": sum(r["requests"] for r in runs), "rounds": len(runs)}
    cell["errors"] = sum(r["errors"] for r in runs)
    for key in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request", "cpu_utilisation"):
        present = [r[key] for r in runs if r[key] is not None]
        cell[key] = statistics.median(present) if present else None
    return cell


def run_routing_bench(rig: Rig, log=print) -> list[dict]:
    """The cells: target (direct, sglang_router, smg, gateway), mode, in flight, requests,
    errors, rps, p50_ms and p99_ms, the router's CPU per request and its share of one core."""
    targets = [
        ("direct", rig.direct_url, None),
        *((name, router.url, router.pid) for name, router in rig.routers.items()),
        ("gateway", rig.gateway_url, rig.gateway_pid),
    ]
    for _, url, _ in targets:  # warm every path (connection pools, tokenizer, auth cache)
        for stream in (False, True):
            body = request_body(stream)
            run_wrk(
                url + "/v1/completions", body, connections=4, duration_s=1, auth=rig.gateway_key
            )
    cells: list[dict] = []
    for mode in ("plain", "stream", "ttft"):
        for concurrency in rig.config.concurrencies:
            runs: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
            for _ in range(rig.config.routing_rounds):
                for name, url, pgid in targets:
                    cpu_before = group_cpu_seconds(pgid) if pgid else 0.0
                    wall_before = time.perf_counter()
                    cell = {"target": name, "mode": mode, "concurrency": concurrency}
                    cell |= _measure(rig, mode, concurrency, url)
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
