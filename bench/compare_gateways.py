"""Before/after: two gateway checkouts side by side in one run, on the same instant backends.

    .venv/bin/python -m bench.compare_gateways --b /tmp/isogate-patched [--a .] [--seconds 5]
        [--rounds 3] [--concurrency 16] [--modes plain] [--b-env ISOGATE_LOG_LEVEL=warning]

Each cell (non-streaming and streaming, 1/16/64 in flight) runs A then B back to back
(after a 1 s warm-up each), ``--rounds`` times alternating, so a noisy neighbour hits both;
both gateways are pinned to the same CPU (one at a time under load). Prints req/s, p50, p99
and the gateway's CPU per request of each run, and the median CPU per request of each side.
On this kind of machine one run of a cell moves by ±15 %: use three rounds or more.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import (
    REPO_ROOT,
    boost,
    cpu_seconds,
    start_gateway,
)
from bench.rig import INSTANT_GATEWAY_ENV, instant_pair
from bench.routing_bench import request_body
from bench.wrk import run_wrk
from gateway.dev.harness import GatewayProcess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_side_arguments(parser)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--concurrency",
        type=int,
        action="append",
        help="cells to run (default: all of the suite's)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternate A and B this many times per cell"
    )
    parser.add_argument(
        "--modes", default="plain,stream", help="plain, stream or both (comma-separated)"
    )
    args = parser.parse_args(argv)
    config = BenchConfig.from_env()
    if config.helper_cpus:
        os.sched_setaffinity(0, config.helper_cpus)
    boost(os.getpid(), config.priority)
    work = Path(tempfile.mkdtemp(prefix="isogate-compare-"))
    gateways: dict[str, tuple[GatewayProcess, str]] = {}
    rig = contextlib.ExitStack()
    try:
        policies = rig.enter_context(instant_pair(config, work))
        ports = config.ports
        for side in sides(args, ports.gateway):
            gateways[side.name] = start_gateway(
                policies,
                work / side.name,
                side.port,
                cpus=config.router_cpus,
                priority=config.priority,
                env={**INSTANT_GATEWAY_ENV, **side.env},
                root=None if side.root.resolve() == REPO_ROOT else side.root,
            )
        print(f"A = {args.a}\nB = {args.b}")
        modes = {mode.strip() for mode in args.modes.split(",")}
        for stream in [mode == "stream" for mode in ("plain", "stream") if mode in modes]:
            for concurrency in args.concurrency or config.concurrencies:
                cpu_per_request: dict[str, list[CellResult]] = {name: [] for name in gateways}
                # A and B alternate: a neighbour's burst lands on both, and the median sees
                # through it.
                for _ in range(args.rounds):
                    for name, (gateway, key) in gateways.items():
                        cpu_per_request[name].append(
                            _cell(gateway, key, stream, concurrency, args.seconds, config)
                        )
                        print(
                            f"{'stream' if stream else 'plain':6} c={concurrency:<3} {name}: "
                            f"{cpu_per_request[name][-1].line}",
                            flush=True,
                        )
                if args.rounds > 1:
                    medians = {
                        name: statistics.median(cell.cpu_us for cell in cells)
                        for name, cells in cpu_per_request.items()
                    }
                    print(
                        f"{'stream' if stream else 'plain':6} c={concurrency:<3} "
                        "median CPU µs/req: "
                        + "  ".join(f"{name} {value:.0f}" for name, value in medians.items())
                        + f"  (B/A {medians['B'] / medians['A']:.2f})",
                        flush=True,
                    )
    finally:
        for gateway, _ in gateways.values():
            gateway.stop()
        rig.close()
    return 0


@dataclass(frozen=True)
class Side:
    """One gateway of a before/after run: its checkout, port and extra environment."""

    name: str
    root: Path
    port: int
    env: dict[str, str]


def add_side_arguments(parser: argparse.ArgumentParser) -> None:
    """``--a``/``--b`` (the checkouts) and ``--a-env``/``--b-env`` (their extra environment)."""
    parser.add_argument(
        "--a", type=Path, default=REPO_ROOT, help="checkout whose gateway/ is A (default: this one)"
    )
    parser.add_argument("--b", type=Path, required=True, help="checkout whose gateway/ is B")
    for name in ("a", "b"):
        parser.add_argument(
            f"--{name}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"extra environment for {name.upper()}",
        )


def sides(args: argparse.Namespace, first_port: int) -> list[Side]:
    return [
        Side(name, root, first_port + offset, dict(item.split("=", 1) for item in env))
        for offset, (name, root, env) in enumerate(
            (("A", args.a, args.a_env), ("B", args.b, args.b_env))
        )
    ]


@dataclass(frozen=True)
class CellResult:
    cpu_us: float
    line: str


def _cell(
    gateway: GatewayProcess,
    key: str,
    stream: bool,
    concurrency: int,
    seconds: float,
    config: BenchConfig,
) -> CellResult:
    url, body = gateway.url + "/v1/completions", request_body(stream)
    run_wrk(url, body, connections=concurrency, duration_s=1, auth=key, cpus=config.helper_cpus)
    assert gateway.process is not None
    cpu_before, wall_before = cpu_seconds(gateway.process.pid), time.perf_counter()
    result = run_wrk(
        url, body, connections=concurrency, duration_s=seconds, auth=key, cpus=config.helper_cpus
    )
    cpu = cpu_seconds(gateway.process.pid) - cpu_before
    wall = time.perf_counter() - wall_before
    cpu_us = cpu / max(1, result.requests) * 1e6
    return CellResult(
        cpu_us,
        f"{result.rps:7.0f} req/s  p50 {result.p50_ms:8.3f} ms  p99 {result.p99_ms:8.3f} ms  "
        f"CPU {cpu_us:6.0f} µs/req ({cpu / wall:.0%} of a core)  errors {result.errors}",
    )


if __name__ == "__main__":
    raise SystemExit(main())
