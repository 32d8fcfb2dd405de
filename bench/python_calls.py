"""Python function calls per request, two checkouts side by side, by module: where a CPU
difference that ``bench.instructions`` measured comes from.

callgrind (``bench.instructions``, ``bench.callgrind_diff``) counts instructions exactly, but
sees the interpreter's C functions, not which Python code ran. This runs each gateway (A, B)
in front of the instant backends under cProfile (``bench/cprofile_serve.py``), switched on for
exactly ``--requests`` requests after a warm-up, and reports per request: the calls and the
profiled CPU time of each module (``gateway/...``, a library, the built-ins), then the
functions whose calls differ most. A call count is exact and repeats; the microseconds are
the main thread's CPU time under the profiler, which inflates cheap calls: read them as shares.

``--opcodes`` counts, instead of the profiler's time, the bytecode instructions each function
executed (exact, the same on every run): per module, then the functions whose opcodes differ
most, then A's largest. A step that cuts interpreted work shows there in one run of a minute,
where ``bench.instructions`` needs several.

    .venv/bin/python -m bench.python_calls --b OTHER_CHECKOUT [--a .] [--requests 2000]
        [--concurrency 16] [--stream] [--top 25] [--opcodes] [--save-profiles DIR]
        [--a-env/--b-env NAME=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import pstats
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.compare_gateways import sides
from bench.config import BenchConfig
from bench.instructions import CLOCK_WORK_OFF, add_load_arguments, send_requests
from bench.processes import start_gateway
from bench.rig import INSTANT_GATEWAY_ENV, instant_pair
from bench.routing_bench import request_body

WRAPPER = Path(__file__).with_name("cprofile_serve.py")


@dataclass
class Profile:
    """One side's counts over its requests: by module and by function."""

    requests: int
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    # Profiled seconds, or opcodes executed (``--opcodes``), by module and by function.
    cost: collections.Counter[str] = field(default_factory=collections.Counter)
    function_calls: collections.Counter[str] = field(default_factory=collections.Counter)
    function_cost: collections.Counter[str] = field(default_factory=collections.Counter)

    def per_request(self, count: float) -> float:
        return count / self.requests


def module_of(filename: str, root: Path) -> str:
    """``gateway/x.py`` for the measured checkout's code, ``lib:name`` for an installed
    package, ``stdlib:name`` for the standard library, ``built-in`` for C functions."""
    if filename == "~":
        return "built-in"
    if "site-packages/" in filename:
        return "lib:" + filename.split("site-packages/", 1)[1].split("/", 1)[0]
    with contextlib.suppress(ValueError):
        return str(Path(filename).relative_to(root))
    return "stdlib:" + Path(filename).name


def read_profile(path: Path, root: Path, requests: int) -> Profile:
    profile = Profile(requests)
    stats = pstats.Stats(str(path)).stats
    for (filename, _line, name), (_primitive, calls, own_s, _cum, _callers) in stats.items():
        module = module_of(filename, root)
        profile.calls[module] += calls
        profile.cost[module] += own_s
        profile.function_calls[f"{module}:{name}"] += calls
        profile.function_cost[f"{module}:{name}"] += own_s
    return profile


def read_opcodes(path: Path, root: Path, requests: int) -> Profile:
    """``cprofile_serve.py --opcodes``'s JSON, keyed as ``read_profile`` keys its functions."""
    profile = Profile(requests)
    for key, (opcodes, calls) in json.loads(path.read_text()).items():
        filename, _line, name = key.rsplit(":", 2)
        module = module_of(filename, root)
        profile.calls[module] += calls
        profile.cost[module] += opcodes
        profile.function_calls[f"{module}:{name}"] += calls
        profile.function_cost[f"{module}:{name}"] += opcodes
    return profile


def drive(url: str, key: str, body: bytes, args: argparse.Namespace, requests: int) -> None:
    asyncio.run(
        send_requests(
            url, key, body, requests=requests, concurrency=args.concurrency, stream=args.stream
        )
    )


def profiled_requests(
    pid: int, out: Path, url: str, key: str, body: bytes, args: argparse.Namespace
) -> None:
    os.kill(pid, signal.SIGUSR1)
    drive(url, key, body, args, args.requests)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 60
    while not out.exists() or out.stat().st_size == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway wrote no profile to {out}")
        time.sleep(0.1)
    time.sleep(0.5)  # the dump is written in one go; let it finish


def report(a: Profile, b: Profile, top: int, *, opcodes: bool) -> None:
    cost, unit = ("opcodes", 1.0) if opcodes else ("profiled us", 1e6)
    for what, a_total, b_total, scale in (
        ("calls", a.calls.total(), b.calls.total(), 1.0),
        (cost, a.cost.total(), b.cost.total(), unit),
    ):
        a_each, b_each = a.per_request(a_total) * scale, b.per_request(b_total) * scale
        print(f"{what} per request: A {a_each:.0f}  B {b_each:.0f}  (B/A {b_each / a_each:.3f})")
    print(f"\n{'calls/req A':>11} {'B':>7} {cost + '/req A':>14} {'B':>7}  module")
    modules = set(a.calls) | set(b.calls)
    for module in sorted(modules, key=lambda m: -(a.cost[m] + b.cost[m]))[:top]:
        print(
            f"{a.per_request(a.calls[module]):11.1f} {b.per_request(b.calls[module]):7.1f} "
            f"{a.per_request(a.cost[module]) * unit:14.1f} "
            f"{b.per_request(b.cost[module]) * unit:7.1f}  {module}"
        )
    functions = set(a.function_calls) | set(b.function_calls)
    measure, label = (a.function_cost, b.function_cost), cost
    if not opcodes:  # the profiler's time per function inflates cheap ones: compare calls
        measure, label = (a.function_calls, b.function_calls), "calls"

    def row(name: str) -> str:
        counts = [side.per_request(m[name]) for side, m in zip((a, b), measure, strict=True)]
        return f"{counts[0]:11.1f} {counts[1]:7.1f}  {name}"

    print(f"\n{label + '/req A':>11} {'B':>7}  function (largest differences)")
    for name in sorted(functions, key=lambda n: -abs(measure[0][n] - measure[1][n]))[:top]:
        print(row(name))
    if opcodes:
        print(f"\n{label + '/req A':>11} {'B':>7}  function (A's largest)")
        for name in sorted(functions, key=lambda n: -measure[0][n])[:top]:
            print(row(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_load_arguments(parser, requests=2000, warmup=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--opcodes", action="store_true", help="count bytecode instructions, not profiled time"
    )
    parser.add_argument(
        "--save-profiles",
        type=Path,
        metavar="DIR",
        help="copy each side's counts there: A.prof, B.prof (pstats) or A.json, B.json",
    )
    args = parser.parse_args(argv)
    config = BenchConfig.from_env()
    work = Path(tempfile.mkdtemp(prefix="isogate-python-calls-"))
    profiles: dict[str, Profile] = {}
    suffix, read = ("json", read_opcodes) if args.opcodes else ("prof", read_profile)
    flag = " --opcodes" if args.opcodes else ""
    try:
        with contextlib.ExitStack() as rig:
            policies = rig.enter_context(instant_pair(config, work))
            body = request_body(args.stream)
            for side in sides(args, config.ports.gateway):
                root, out = side.root.resolve(), work / f"{side.name}.{suffix}"
                gateway, key = start_gateway(
                    policies,
                    work / side.name,
                    side.port,
                    cpus=config.router_cpus,
                    env={**INSTANT_GATEWAY_ENV, **CLOCK_WORK_OFF, **side.env},
                    root=root,
                    command_prefix=["/bin/sh", "-c", f'exec "$0" {WRAPPER} {out}{flag} "$@"'],
                )
                rig.callback(gateway.stop)
                assert gateway.process is not None
                url = gateway.url + "/v1/completions"
                drive(url, key, body, args, args.warmup)  # not counted
                profiled_requests(gateway.process.pid, out, url, key, body, args)
                profiles[side.name] = read(out, root, args.requests)
        mode = "stream" if args.stream else "plain"
        print(f"A = {args.a}\nB = {args.b}\n{mode} c={args.concurrency}")
        report(profiles["A"], profiles["B"], args.top, opcodes=args.opcodes)
        if args.save_profiles is not None:
            args.save_profiles.mkdir(parents=True, exist_ok=True)
            for name in profiles:
                shutil.copy(work / f"{name}.{suffix}", args.save_profiles / f"{name}.{suffix}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
