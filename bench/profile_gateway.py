"""Profile the gateway under load with py-spy: where its CPU goes per request.

Starts the instant backends and the gateway (no sglang_router), drives the gateway with
``wrk`` at a given concurrency and records it with ``py-spy record`` (collapsed stacks plus
an SVG flamegraph under ``bench/results/``); prints the functions holding the most samples,
by self time and by inclusive time.

    .venv/bin/python -m bench.profile_gateway [--concurrency 16] [--seconds 10] [--stream]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import (
    start_gateway,
)
from bench.rig import INSTANT_GATEWAY_ENV, instant_pair
from bench.routing_bench import request_body
from bench.wrk import run_wrk

RESULTS = Path(__file__).resolve().parent / "results"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: .venv/bin/pip install py-spy")
    return found


def summarise(collapsed: Path, top: int = 25) -> str:
    """Self and inclusive sample counts per function from py-spy's collapsed (raw) output."""
    self_counts: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples"]
    lines.append("-- self --")
    lines += [f"{n / total:6.1%}  {frame}" for frame, n in self_counts.most_common(top)]
    lines.append("-- inclusive --")
    lines += [f"{n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    args = parser.parse_args(argv)
    config = BenchConfig.from_env()
    if config.helper_cpus:
        os.sched_setaffinity(0, config.helper_cpus)
    RESULTS.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="isogate-profile-"))
    gateway = None
    rig = contextlib.ExitStack()
    try:
        policies = rig.enter_context(instant_pair(config, work))
        ports = config.ports
        gateway, key = start_gateway(
            policies,
            work / "gateway",
            ports.gateway,
            cpus=config.router_cpus,
            priority=config.priority,
            root=config.gateway_root,
            env=INSTANT_GATEWAY_ENV,
        )
        url = gateway.url + "/v1/completions"
        body = request_body(args.stream)
        run_wrk(url, body, connections=4, duration_s=1, auth=key, cpus=config.helper_cpus)  # warm
        name = f"gateway-{'stream' if args.stream else 'plain'}-c{args.concurrency}"
        collapsed, svg = RESULTS / f"{name}.collapsed.txt", RESULTS / f"{name}.svg"
        assert gateway.process is not None
        pid = str(gateway.process.pid)
        record = subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                pid,
                "--rate",
                str(args.rate),
                "--duration",
                str(args.seconds),
                "--format",
                "raw",
                "--output",
                str(collapsed),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        flame = subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                pid,
                "--rate",
                "50",
                "--duration",
                str(args.seconds),
                "--output",
                str(svg),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        result: dict = {}
        load = threading.Thread(
            target=lambda: result.setdefault(
                "wrk",
                run_wrk(
                    url,
                    body,
                    connections=args.concurrency,
                    duration_s=args.seconds,
                    auth=key,
                    cpus=config.helper_cpus,
                ),
            )
        )
        load.start()
        load.join()
        record.wait(timeout=60)
        flame.wait(timeout=60)
        print(f"{name}: {result['wrk']}")
        print(summarise(collapsed))
        print(f"flamegraph: {svg}\ncollapsed stacks: {collapsed}")
    finally:
        if gateway is not None:
            gateway.stop()
        rig.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
