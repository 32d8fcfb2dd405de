"""Fair share on a real SGLang PD pair on the CPU (issue 18): where the pair saturates, the
noisy neighbour with and without the gateway's fair queue, and weights 2 : 1.

    flock /tmp/isogate-engine.lock .venv/bin/python -m bench.fair_share_bench

1. Saturation: requests straight to the pair (no gateway), closed loop at growing concurrency;
   the knee is the smallest concurrency whose throughput is within ``KNEE_FRACTION`` of the
   best seen. It is what ``queue_in_flight_per_pair`` defaults to (docs/operations.md). The
   latency point, the most in flight whose p50 stays within ``LATENCY_FACTOR`` of one alone,
   is what ``queue_in_flight_per_pair_contended`` defaults to.
2. Noisy neighbour: tenant B at 1 in flight alone, then while tenant A keeps 24 and 64 in
   flight, through a gateway whose queue cap is the measured knee and through one whose cap
   is out of reach (no queue). Targets: B's p50 under A within 2x of alone (with the queue);
   the pool's total throughput with the queue at least 90 % of without it.
3. Weights: tenants of weight 2 and 1, both flooding, served 2 : 1 (+-15 %).

Side by side in one run, on one pair: ratios, not absolute figures, are the result.
Environment: BENCH_FAIR_SECONDS (each timed window, default 12), BENCH_FAIR_CAP (the queue
cap to run the gateway with instead of the measured knee), BENCH_FAIR_SWEEP=0 (with a cap
given: skip the saturation sweep), BENCH_FAIR_CONTENDED (comma-separated caps while tenants
contend, ``queue_in_flight_per_pair_contended``: one queue gateway for each, beside the one
without it; default 1,2,4).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson
import yaml

from bench.config import BenchConfig
from bench.processes import BenchModel, BenchPool, free_ports, start_gateway, write_bench_policies
from bench.real_engine_bench import MIN_AVAILABLE_GIB, MODEL, available_gib
from bench.stream_client import RunResult, Target, run_load, run_pd_direct
from gateway.dev.cluster import PDCluster, default_cluster_spec
from gateway.dev.harness import GatewayProcess
from gateway.workers.capacity import ENGINE_PATCH_MARKER

MAX_TOKENS = 16
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
SWEEP = (1, 2, 4, 6, 8, 12, 16, 24, 32)
KNEE_FRACTION = 0.95
LATENCY_FACTOR = 2.0
NO_QUEUE_CAP = 1_000_000  # above any engine's max_running_requests: nothing ever queues
TENANTS = {"tenant-a": {}, "tenant-b": {}, "heavy": {"weight": 2}, "light": {"weight": 1}}


@dataclass
class SweepPoint:
    concurrency: int
    rps: float
    p50_ms: float
    errors: int


@dataclass
class NeighbourCell:
    gateway: str  # "queue" | "no queue"
    a_in_flight: int  # 0: B alone
    b_requests: int
    b_p50_ms: float
    b_p99_ms: float
    total_rps: float
    errors: int


def knee(points: list[SweepPoint], fraction: float = KNEE_FRACTION) -> int:
    """The smallest concurrency whose throughput is within ``fraction`` of the best."""
    best = max(point.rps for point in points)
    return min(point.concurrency for point in points if point.rps >= fraction * best)


def latency_point(points: list[SweepPoint], factor: float = LATENCY_FACTOR) -> int:
    """The most requests in flight whose p50 stays within ``factor`` of one alone."""
    alone = next(point.p50_ms for point in points if point.concurrency == 1)
    return max((point.concurrency for point in points if point.p50_ms <= factor * alone), default=1)


def body(stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}


def sweep(cluster: PDCluster, log=print) -> list[SweepPoint]:
    points = []
    for concurrency in SWEEP:
        result = asyncio.run(
            run_pd_direct(
                cluster.prefill_url,
                cluster.decode_url,
                cluster.bootstrap_port,
                body(),
                concurrency=concurrency,
                total_requests=max(24, concurrency * 6),
            )
        )
        s = result.summary()
        point = SweepPoint(concurrency, s["rps"], s["total_p50_ms"], int(s["non_200"]))
        points.append(point)
        log(
            f"  saturation c={concurrency:<3} {point.rps:6.1f} req/s  p50 {point.p50_ms:7.1f} ms"
            f"  errors {point.errors}"
        )
    return points


@contextlib.contextmanager
def gateway_with_cap(
    cluster: PDCluster,
    work_dir: Path,
    port: int,
    cap: int,
    tags: bool,
    contended: int | None = None,
) -> Iterator[tuple[GatewayProcess, dict[str, str]]]:
    policies = write_bench_policies(
        work_dir / "policies",
        tokenizer_dir=cluster.spec.model_dir,
        models=[
            BenchModel(
                MODEL,
                cluster.spec.prefill.max_total_tokens,
                BenchPool(cluster.prefill_url, cluster.bootstrap_port, cluster.decode_url),
                tags,
            )
        ],
    )
    tenants = yaml.safe_load((policies / "tenants.yaml").read_text())
    tenants["tenants"] = TENANTS
    (policies / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    # Long enough that no queued request of the floods is refused: the bench measures
    # shares and throughput, not the bound on waiting (tests/verification/test_fair_share.py).
    env = {"ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR": str(cap), "ISOGATE_QUEUE_MAX_WAIT_S": "120"}
    if contended is not None:
        env["ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR_CONTENDED"] = str(contended)
    gateway, _ = start_gateway(policies, work_dir / "gateway", port, cpus=None, env=env)
    try:
        keys = {tenant: gateway.create_tenant(tenant)[1] for tenant in TENANTS}
        yield gateway, keys
    finally:
        gateway.stop()


def _target(gateway: GatewayProcess, key: str) -> Target:
    return Target(
        gateway.url + "/v1/completions", orjson.dumps(body()), (("Authorization", f"Bearer {key}"),)
    )


async def _b_while_a(
    gateway: GatewayProcess, keys: dict[str, str], a_in_flight: int, seconds: float
) -> tuple[RunResult, RunResult | None, float]:
    """B at 1 in flight for ``seconds``, inside a window where A keeps ``a_in_flight`` going."""
    b_target, a_target = _target(gateway, keys["tenant-b"]), _target(gateway, keys["tenant-a"])
    if a_in_flight == 0:
        b = await run_load(b_target, concurrency=1, duration_s=seconds, warmup_requests=2)
        return b, None, b.wall_s

    async def b_inside() -> RunResult:
        await asyncio.sleep(seconds / 4)  # A's connections are up and saturating by then
        return await run_load(b_target, concurrency=1, duration_s=seconds)

    started = time.perf_counter()
    a, b = await asyncio.gather(
        run_load(a_target, concurrency=a_in_flight, duration_s=seconds * 1.5, warmup_requests=1),
        b_inside(),
    )
    return b, a, time.perf_counter() - started


def neighbour_cell(
    gateway: GatewayProcess, keys: dict[str, str], name: str, a_in_flight: int, seconds: float
) -> NeighbourCell:
    b, a, _ = asyncio.run(_b_while_a(gateway, keys, a_in_flight, seconds))
    bs = b.summary()
    total_rps = bs["rps"] if a is None else a.summary()["rps"]
    if a is not None:
        # B's requests in the same window count towards what the pool served.
        total_rps += bs["requests"] / a.wall_s
    errors = int(bs["non_200"]) + (int(a.summary()["non_200"]) if a is not None else 0)
    return NeighbourCell(
        name,
        a_in_flight,
        int(bs["requests"]),
        bs["total_p50_ms"],
        bs["total_p99_ms"],
        total_rps,
        errors,
    )


def noisy_neighbour(
    gateways: dict[str, tuple[GatewayProcess, dict[str, str]]], seconds: float, log=print
) -> list[NeighbourCell]:
    """Each load with every gateway in turn, cell by cell: on a shared host the load of the
    machine drifts, and interleaving puts the compared cells as close in time as they can be."""
    cells = []
    for a_in_flight in (0, 24, 64):
        for name, (gateway, keys) in gateways.items():
            cell = neighbour_cell(gateway, keys, name, a_in_flight, seconds)
            cells.append(cell)
            log(
                f"  {name:12} A={a_in_flight:<3} B n={cell.b_requests:<4} "
                f"p50 {cell.b_p50_ms:7.1f} ms  p99 {cell.b_p99_ms:7.1f} ms  "
                f"pool {cell.total_rps:6.1f} req/s  errors {cell.errors}"
            )
    return cells


def served_counts(gateway: GatewayProcess) -> dict[str, float]:
    """Requests each tenant was served by the gateway's queues (its /metrics), so far."""
    text = httpx.get(
        gateway.url + "/metrics",
        headers={"Authorization": f"Bearer {gateway.admin_key}"},
        timeout=30,
    ).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("isogate_queue_served_total{"):
            series, value = line.rsplit(" ", 1)
            tenant = series.split('tenant="', 1)[1].split('"', 1)[0]
            counts[tenant] = counts.get(tenant, 0.0) + float(value)
    return counts


def weights(
    name: str, gateway: GatewayProcess, keys: dict[str, str], seconds: float, log=print
) -> dict:
    """Both tenants at 24 in flight for ``2 * seconds``; the shares are what the queue served
    between a third of the way in (both long backlogged) and just before the end, so that
    neither the first slots (taken in arrival order, before anyone waits) nor the last count."""
    duration = 2 * seconds

    async def both() -> tuple[RunResult, RunResult, dict[str, float]]:
        loads = asyncio.gather(
            run_load(_target(gateway, keys["heavy"]), concurrency=24, duration_s=duration),
            run_load(_target(gateway, keys["light"]), concurrency=24, duration_s=duration),
        )
        await asyncio.sleep(duration / 3)
        first = await asyncio.to_thread(served_counts, gateway)
        await asyncio.sleep(duration * 0.6)
        last = await asyncio.to_thread(served_counts, gateway)
        heavy, light = await loads
        window = {t: last.get(t, 0.0) - first.get(t, 0.0) for t in ("heavy", "light")}
        return heavy, light, window

    heavy, light, window = asyncio.run(both())
    completed = {"heavy": len(heavy.ok()), "light": len(light.ok())}
    ratio = window["heavy"] / window["light"] if window["light"] else float("inf")
    errors = heavy.errors + light.errors + int(heavy.summary()["non_200"])
    errors += int(light.summary()["non_200"])
    log(
        f"  {name:12} weights 2:1, both at 24 in flight: served in the window {window}, "
        f"ratio {ratio:.2f}"
        f" (completed over the whole run {completed}); errors {errors}"
    )
    return {"served": window, "completed": completed, "ratio": ratio, "errors": errors}


def targets(result: dict) -> dict[str, bool | None]:
    """Each target of issue 18, met or not, for each queue gateway of one run."""
    cells = {(c["gateway"], c["a_in_flight"]): c for c in result.get("neighbour", [])}
    met: dict[str, bool | None] = {}
    queues = [name for name, a in cells if a == 0 and name != "no queue"]
    for name in queues:
        alone = cells.get((name, 0))
        for a_in_flight in (24, 64):
            with_queue, without = (
                cells.get((name, a_in_flight)),
                cells.get(("no queue", a_in_flight)),
            )
            if alone and with_queue:
                met[f"{name}: B p50 with A at {a_in_flight} <= 2x alone"] = (
                    with_queue["b_p50_ms"] <= 2 * alone["b_p50_ms"]
                )
            if with_queue and without:
                met[f"{name}: pool throughput with A at {a_in_flight} >= 90% of no queue"] = (
                    with_queue["total_rps"] >= 0.9 * without["total_rps"]
                )
        weighed = result.get("weights", {}).get(name)
        if weighed:
            met[f"{name}: weights 2:1 served 2:1 +-15%"] = abs(weighed["ratio"] - 2) <= 0.3
    return met


def run_fair_share_bench(config: BenchConfig, work_dir: Path, log=print) -> dict:
    free = available_gib()
    if free < MIN_AVAILABLE_GIB:
        return {"skipped": f"only {free:.1f} GiB available (< {MIN_AVAILABLE_GIB} GiB)"}
    seconds = float(os.environ.get("BENCH_FAIR_SECONDS", 12))
    ports = config.ports
    spec = default_cluster_spec(
        prefill_port=free_ports(ports.real_prefill),
        decode_port=free_ports(ports.real_decode),
        bootstrap_port=free_ports(ports.real_bootstrap),
        log_dir=work_dir / "sglang-fair",
    )
    cluster = PDCluster(spec)
    started = time.monotonic()
    try:
        cluster.start()
        log(f"  PD pair ready in {time.monotonic() - started:.0f} s")
        info = httpx.get(f"{cluster.decode_url}/server_info", timeout=10).json()
        tags = bool(info.get(ENGINE_PATCH_MARKER))
        given = os.environ.get("BENCH_FAIR_CAP")
        # BENCH_FAIR_SWEEP=0 with a cap given: the noisy neighbour and weights alone.
        run_sweep = os.environ.get("BENCH_FAIR_SWEEP", "1") != "0" or given is None
        points = sweep(cluster, log) if run_sweep else []
        measured = knee(points) if points else None
        cap = int(given) if given is not None else int(measured or 1)
        log(f"  knee (>= {KNEE_FRACTION:.0%} of the best throughput): {measured}; queue cap {cap}")
        within = latency_point(points) if points else None
        log(f"  most in flight with p50 <= {LATENCY_FACTOR:g}x alone: {within}")
        contended = [
            int(c) for c in os.environ.get("BENCH_FAIR_CONTENDED", "1,2,4").split(",") if c
        ]
        result: dict = {
            "sweep": [asdict(p) for p in points],
            "knee": measured,
            "latency_point": within,
            "cap": cap,
            "contended": contended,
            "seconds": seconds,
            "max_tokens": MAX_TOKENS,
        }
        variants: list[tuple[str, int, int | None]] = [
            ("queue", cap, None),
            *((f"queue c={c}", cap, c) for c in contended),
            ("no queue", NO_QUEUE_CAP, None),
        ]
        with contextlib.ExitStack() as running:
            # Both gateways up at once (an idle one costs the pair nothing), on their own ports.
            gateways = {
                name: running.enter_context(
                    gateway_with_cap(
                        cluster,
                        work_dir / f"fair-{name.replace(' ', '-').replace('=', '')}",
                        ports.real_gateway + offset,
                        gateway_cap,
                        tags,
                        gateway_contended,
                    )
                )
                for offset, (name, gateway_cap, gateway_contended) in enumerate(variants)
            }
            neighbour = noisy_neighbour(gateways, seconds, log)
            result["weights"] = {
                name: weights(name, *gateways[name], seconds, log)
                for name, _, _ in variants
                if name != "no queue"
            }
        result["neighbour"] = [asdict(c) for c in neighbour]
        result["targets"] = targets(result)
        for target, ok in result["targets"].items():
            log(f"  target {'MET' if ok else 'MISSED'}: {target}")
        return result
    except Exception as exc:  # report, never leave the pair running
        log(f"  fair-share run failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    finally:
        cluster.stop()


def render(result: dict) -> list[str]:
    """The section's lines for bench/results/latest.md."""
    if "sweep" not in result:
        return [f"Not run: {result.get('skipped') or result.get('failed')}", ""]
    if result["sweep"]:
        out = [
            f"Saturation of the pair (straight to the workers, closed loop, {MAX_TOKENS} tokens "
            f"out): knee = {result['knee']} in flight (smallest within {KNEE_FRACTION:.0%} of "
            f"the best throughput); gateway queue cap {result['cap']}; most in flight with a "
            f"p50 within {LATENCY_FACTOR:g}x of one alone: {result.get('latency_point')}.",
            "",
            "| in flight | req/s | p50 ms | errors |",
            "|---|---|---|---|",
            *(
                f"| {p['concurrency']} | {p['rps']:.1f} | {p['p50_ms']:.1f} | {p['errors']} |"
                for p in result["sweep"]
            ),
            "",
        ]
    else:
        out = [f"Saturation sweep not run (BENCH_FAIR_SWEEP=0); queue cap {result['cap']}.", ""]
    out += [
        f"Noisy neighbour ({result['seconds']:.0f} s windows): tenant B at 1 in flight.",
        "",
        "| gateway | A in flight | B requests | B p50 ms | B p99 ms | pool req/s | errors |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {c['gateway']} | {c['a_in_flight']} | {c['b_requests']} | {c['b_p50_ms']:.1f} "
            f"| {c['b_p99_ms']:.1f} | {c['total_rps']:.1f} | {c['errors']} |"
            for c in result["neighbour"]
        ),
        "",
    ]
    for name, w in result.get("weights", {}).items():
        out += [
            f"Weights 2 : 1 through {name}, both at 24 in flight: served (by the queue, in the "
            f"steady part of the run) {w['served']}, ratio {w['ratio']:.2f}; completed over the "
            f"whole run {w.get('completed')}.",
            "",
        ]
    out += [f"- {'met' if ok else 'MISSED'}: {t}" for t, ok in result.get("targets", {}).items()]
    return [*out, ""]


def main() -> int:
    config = BenchConfig.from_env()
    work = Path(tempfile.mkdtemp(prefix="isogate-fair-"))
    result = run_fair_share_bench(config, work)
    print(json.dumps(result, indent=1, default=str))
    print("\n".join(render(result)))
    return 0 if "sweep" in result else 1


if __name__ == "__main__":
    sys.exit(main())
