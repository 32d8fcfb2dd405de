"""Section 1: added latency and throughput of sglang_router, SMG and the gateway, against direct.

All of them get the same client request (``POST /v1/completions``, a short prompt, 4 output
tokens) in front of the same instant backend: "direct" sends it straight to the decode
backend (one hop, the floor), ``sglang_router`` and SMG (PD mode; SMG where ``.venv-smg`` is
installed) and the gateway forward it to prefill and decode. ``wrk`` measures whole responses
(non-streaming, and streaming where the whole stream is 4 chunks sent back to back);
``bench.stream_client`` measures streaming time to first token. Targets are interleaved inside
each cell, so a noisy neighbour hits them all, and each cell runs ``config.routing_rounds``
times (targets interleaved in every round); a target's figures for the cell are the medians
over the rounds (requests and errors: totals).

CPU per request is the router process's own CPU time over the run divided by the requests it
served: at saturation it is the cost figure that does not depend on where the bottleneck is.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass

import orjson

from bench.processes import group_cpu_seconds
from bench.rig import MODEL, Rig
from bench.stream_client import Target, run_load
from bench.wrk import run_wrk

PROMPT = "Summarise the following in one line: the gateway checks tenant isolation end to end."


@dataclass
class Cell:
    target: str  # direct | sglang_router | smg | gateway
    mode: str  # plain | stream (wrk: whole response) | ttft (stream_client: first body byte)
    concurrency: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float | None
    cpu_utilisation: float | None  # of the router's process, share of one core
    rounds: int = 1  # runs this cell is the median of


def request_body(stream: bool) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream})


def _targets(rig: Rig) -> list[tuple[str, str, int | None]]:
    smg = rig.smg
    peers = [("smg", f"http://127.0.0.1:{smg.port}", smg.pid)] if smg is not None else []
    return [
        ("direct", rig.direct_url, None),
        ("sglang_router", rig.router_url, rig.router.pid),
        *peers,
        ("gateway", rig.gateway_url, rig.gateway_pid),
    ]


def _cpu(pgid: int | None) -> float:
    return group_cpu_seconds(pgid) if pgid is not None else 0.0


def run_routing_bench(rig: Rig, log=print) -> list[Cell]:
    config = rig.config
    cells: list[Cell] = []
    # Warm every path (connection pools, tokenizer, auth cache).
    for _, url, _ in _targets(rig):
        for stream in (False, True):
            run_wrk(
                url + "/v1/completions",
                request_body(stream),
                connections=4,
                duration_s=1,
                auth=rig.gateway_key,
                cpus=config.helper_cpus,
            )
    for stream in (False, True):
        mode = "stream" if stream else "plain"
        for concurrency in config.concurrencies:
            runs: dict[str, list[Cell]] = {name: [] for name, _, _ in _targets(rig)}
            for _ in range(config.routing_rounds):
                for name, url, pgid in _targets(rig):
                    cpu_before, wall_before = _cpu(pgid), time.perf_counter()
                    result = run_wrk(
                        url + "/v1/completions",
                        request_body(stream),
                        connections=concurrency,
                        duration_s=config.wrk_duration_s,
                        auth=rig.gateway_key,
                        cpus=config.helper_cpus,
                    )
                    cpu, wall = _cpu(pgid) - cpu_before, time.perf_counter() - wall_before
                    runs[name].append(
                        _logged(
                            log,
                            Cell(
                                name,
                                mode,
                                concurrency,
                                result.requests,
                                result.errors,
                                result.rps,
                                result.p50_ms,
                                result.p99_ms,
                                cpu / result.requests * 1e6 if pgid and result.requests else None,
                                cpu / wall if pgid else None,
                            ),
                        )
                    )
            cells += [_median(runs[name]) for name in runs]
    for concurrency in config.concurrencies:
        runs = {name: [] for name, _, _ in _targets(rig)}
        for _ in range(config.routing_rounds):
            for name, url, pgid in _targets(rig):
                target = Target(
                    url + "/v1/completions",
                    request_body(True),
                    (("Authorization", f"Bearer {rig.gateway_key}"),),
                )
                cpu_before, wall_before = _cpu(pgid), time.perf_counter()
                result = asyncio.run(
                    run_load(
                        target,
                        concurrency=concurrency,
                        duration_s=config.ttft_duration_s,
                        warmup_requests=1,
                    )
                )
                cpu, wall = _cpu(pgid) - cpu_before, time.perf_counter() - wall_before
                summary = result.summary()
                runs[name].append(
                    _logged(
                        log,
                        Cell(
                            name,
                            "ttft",
                            concurrency,
                            int(summary["requests"]),
                            int(summary["non_200"]),
                            summary["rps"],
                            summary["ttft_p50_ms"],
                            summary["ttft_p99_ms"],
                            cpu / summary["requests"] * 1e6
                            if pgid and summary["requests"]
                            else None,
                            cpu / wall if pgid else None,
                        ),
                    )
                )
        cells += [_median(runs[name]) for name in runs]
    return cells


def _logged(log, cell: Cell) -> Cell:  # type: ignore[no-untyped-def]
    log(
        f"  {cell.mode:6} c={cell.concurrency:<3} {cell.target:14} {cell.rps:8.0f} req/s  "
        f"p50 {cell.p50_ms:7.3f} ms  p99 {cell.p99_ms:7.3f} ms  errors {cell.errors}"
        + (
            f"  cpu {cell.cpu_us_per_request:.0f} us/req ({cell.cpu_utilisation:.0%} of a core)"
            if cell.cpu_us_per_request is not None and cell.cpu_utilisation is not None
            else ""
        )
    )
    return cell


def _median(runs: list[Cell]) -> Cell:
    """One target's runs of one cell as one cell: medians, with requests and errors summed."""

    def median(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return statistics.median(present) if present else None

    first = runs[0]
    return Cell(
        first.target,
        first.mode,
        first.concurrency,
        sum(r.requests for r in runs),
        sum(r.errors for r in runs),
        statistics.median(r.rps for r in runs),
        statistics.median(r.p50_ms for r in runs),
        statistics.median(r.p99_ms for r in runs),
        median([r.cpu_us_per_request for r in runs]),
        median([r.cpu_utilisation for r in runs]),
        len(runs),
    )


def cells_as_json(cells: list[Cell]) -> list[dict]:
    return [asdict(c) for c in cells]
