"""CPU per request counted in instructions: a before/after figure that repeats.

The problem: on this kind of machine one cell of ``bench.compare_gateways`` moves by ±20 % from
run to run (the neighbour, the CPU's clock, caches), and even its median of three rounds moved
the baseline by half between two runs of one hour. A step of 5-10 % cannot be seen that way.
valgrind's callgrind counts the instructions a process executes, every thread, user space: the
same for the same code and the same requests, whatever else the machine is doing.

Each gateway (A, B) runs as in ``compare_gateways`` (``python -m gateway serve`` in front of the
instant backends), under callgrind with instrumentation off while it starts and warms up. It is
switched on for exactly ``--requests`` requests sent by a fixed-count client at ``--concurrency``
in flight, dumped and switched off; the figure is the instruction total over the requests.
A and B alternate ``--rounds`` times.

    .venv/bin/python -m bench.instructions --b OTHER_CHECKOUT [--a .] [--requests 300]
        [--concurrency 16] [--stream] [--rounds 2] [--a-env/--b-env NAME=VALUE] [--keep]

Not counted: the kernel's work in system calls (socket reads and writes, the same for both
sides), which the seconds of ``compare_gateways`` do include. The gateway runs many times slower
under valgrind, so at a given concurrency more requests wait together than in a timed run;
both sides wait alike. Nor the work the gateway does by the clock (``CLOCK_WORK_OFF``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import httpx

from bench.compare_gateways import add_side_arguments, sides
from bench.config import BenchConfig
from bench.processes import start_gateway
from bench.rig import INSTANT_GATEWAY_ENV, instant_pair
from bench.routing_bench import request_body
from gateway.dev.harness import GatewayProcess

# Work that runs by the clock, not per request, kept out of the count: under valgrind the gateway
# runs many times slower, so a capacity poll each second and an audit flush every 20 ms fall on
# a handful of requests each (one audit commit per row or two, where at full speed a batch holds
# many), and how many fall in the window moves with how fast the host is at that moment. Polled
# once at start and then rarely (observations kept routable meanwhile), flushed twice a second:
# one side's rounds then agree within 3 % (often 1 %), where they moved by 8 %. The sweeps of
# deadlines (``gateway.common.deadlines``) run once a second instead of ten times. A side's own
# ``--a-env``/``--b-env`` values win.
CLOCK_WORK_OFF = {
    "ISOGATE_CAPACITY_POLL_INTERVAL_S": "300",
    "ISOGATE_CAPACITY_STALE_AFTER_S": "3600",
    "ISOGATE_CAPACITY_MAX_AGE_IF_ALIVE_S": "3600",
    "ISOGATE_AUDIT_FLUSH_INTERVAL_S": "0.5",
    "ISOGATE_DEADLINE_RESOLUTION_S": "1",
}

# The ``totals:`` line; a dump's ``summary:`` line is wrong after the first toggle.
_TOTALS = re.compile(rb"^totals:\s+(\d+)", re.MULTILINE)


def callgrind_prefix(out_dir: Path) -> list[str]:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is missing (Debian package valgrind)")
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/callgrind.%p",
        "--dump-line=no",
    ]


async def send_requests(
    url: str, key: str, body: bytes, *, requests: int, concurrency: int, stream: bool
) -> None:
    """Exactly ``requests`` requests, ``concurrency`` at a time; each must be answered 200."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    left = requests
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                if stream:
                    async with client.stream("POST", url, content=body, headers=headers) as reply:
                        await reply.aread()
                else:
                    reply = await client.post(url, content=body, headers=headers)
                if reply.status_code != 200:
                    raise RuntimeError(f"the gateway answered {reply.status_code}: {reply.text}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def add_load_arguments(parser: argparse.ArgumentParser, *, requests: int, warmup: int) -> None:
    """The two checkouts (``add_side_arguments``) and the load counted on each: ``--requests``
    after ``--warmup`` ones, ``--concurrency`` in flight, ``--stream`` or not."""
    add_side_arguments(parser)
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true")


def _callgrind_control(*args: str) -> None:
    subprocess.run(
        ["callgrind_control", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def instructions_per_request(
    gateway: GatewayProcess,
    key: str,
    out_dir: Path,
    *,
    requests: int,
    concurrency: int,
    stream: bool,
    keep: bool,
) -> float:
    assert gateway.process is not None
    pid = str(gateway.process.pid)
    url, body = gateway.url + "/v1/completions", request_body(stream)
    _callgrind_control("--instr=on", pid)
    before = set(out_dir.glob(f"callgrind.{pid}*"))
    asyncio.run(
        send_requests(url, key, body, requests=requests, concurrency=concurrency, stream=stream)
    )
    _callgrind_control("--dump", pid)
    _callgrind_control("--instr=off", pid)
    (dump,) = set(out_dir.glob(f"callgrind.{pid}*")) - before
    match = _TOTALS.search(dump.read_bytes())
    if match is None:
        raise RuntimeError(f"no instruction total in {dump}")
    if not keep:
        dump.unlink()
    return int(match.group(1)) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_load_arguments(parser, requests=300, warmup=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory and callgrind's dumps"
    )
    args = parser.parse_args(argv)
    config = BenchConfig.from_env()
    work = Path(tempfile.mkdtemp(prefix="isogate-instructions-"))
    gateways: dict[str, tuple[GatewayProcess, str, Path]] = {}
    rig = contextlib.ExitStack()
    try:
        policies = rig.enter_context(instant_pair(config, work))
        ports = config.ports
        for side in sides(args, ports.gateway):
            out_dir = work / side.name / "callgrind"
            out_dir.mkdir(parents=True)
            gateway, key = start_gateway(
                policies,
                work / side.name,
                side.port,
                cpus=config.router_cpus,
                env={**INSTANT_GATEWAY_ENV, **CLOCK_WORK_OFF, **side.env},
                root=side.root.resolve(),
                command_prefix=callgrind_prefix(out_dir),
                timeout_s=600,
            )
            gateways[side.name] = (gateway, key, out_dir)
        print(f"A = {args.a}\nB = {args.b}", flush=True)
        mode = "stream" if args.stream else "plain"
        body = request_body(args.stream)
        for gateway, key, _ in gateways.values():  # warm-up, not counted
            asyncio.run(
                send_requests(
                    gateway.url + "/v1/completions",
                    key,
                    body,
                    requests=args.warmup,
                    concurrency=args.concurrency,
                    stream=args.stream,
                )
            )
        counts: dict[str, list[float]] = {name: [] for name in gateways}
        for _ in range(args.rounds):
            for name, (gateway, key, out_dir) in gateways.items():
                counts[name].append(
                    instructions_per_request(
                        gateway,
                        key,
                        out_dir,
                        requests=args.requests,
                        concurrency=args.concurrency,
                        stream=args.stream,
                        keep=args.keep,
                    )
                )
                print(
                    f"{mode} c={args.concurrency} {name}: "
                    f"{counts[name][-1] / 1e3:8.0f} k instructions/request",
                    flush=True,
                )
        a, b = (statistics.median(counts[name]) for name in ("A", "B"))
        print(
            f"{mode} c={args.concurrency} median k instructions/request: "
            f"A {a / 1e3:.0f}  B {b / 1e3:.0f}  (B/A {b / a:.3f})",
            flush=True,
        )
    finally:
        for gateway, _, _ in gateways.values():
            gateway.stop()
        rig.close()
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
