"""Profile the gateway under ``wrk`` load with ``py-spy record`` (collapsed stacks and an SVG
flamegraph in ``bench/results/``) and print the functions holding the most samples, self and
inclusive. py-spy charges GIL waits to the frame on top: its shares say where to look.

    scripts/bench --profile [--concurrency 16] [--seconds 10] [--stream]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.config import BenchConfig
from bench.processes import start_gateway
from bench.rig import INSTANT_GATEWAY_ENV, instant_pair
from bench.routing_bench import request_body
from bench.wrk import run_wrk

RESULTS = Path(__file__).resolve().parent / "results"
PY_SPY = Path(sys.executable).parent / "py-spy"  # scripts/bench installs it into .venv


def summarise(collapsed: Path, top: int = 25) -> str:
    """Self and inclusive sample counts per function from py-spy's collapsed (raw) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    total = sum(own.values()) or 1
    lines = [f"{total} samples"]
    for title, counts in (("self", own), ("inclusive", inclusive)):
        lines += [f"-- {title} --", *(f"{n / total:6.1%}  {f}" for f, n in counts.most_common(top))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
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
    with instant_pair(config, work) as (policies, _):
        gateway, key = start_gateway(
            policies, work / "gateway", config.ports.gateway, cpus=config.router_cpus,
            priority=config.priority, root=config.gateway_root, env=INSTANT_GATEWAY_ENV,
        )  # fmt: skip
        try:
            url, body = gateway.url + "/v1/completions", request_body(args.stream)
            run_wrk(url, body, connections=4, duration_s=1, auth=key)  # warm
            name = f"gateway-{'stream' if args.stream else 'plain'}-c{args.concurrency}"
            collapsed, svg = RESULTS / f"{name}.collapsed.txt", RESULTS / f"{name}.svg"
            assert gateway.process is not None
            record = f"record --pid {gateway.process.pid} --duration {args.seconds} --nonblocking"
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            recorders = [
                subprocess.Popen([str(PY_SPY), *record.split(), *options], **quiet)
                for options in (
                    ["--rate", str(args.rate), "--format", "raw", "--output", str(collapsed)],
                    ["--rate", "50", "--output", str(svg)],
                )
            ]
            load = {"connections": args.concurrency, "duration_s": args.seconds, "auth": key}
            result = run_wrk(url, body, **load)
            for recorder in recorders:
                recorder.wait(timeout=60)
        finally:
            gateway.stop()
    print(f"{name}: {result}")
    print(summarise(collapsed))
    print(f"flamegraph: {svg}\ncollapsed stacks: {collapsed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
