"""Fair share on a real SGLang PD pair on the CPU (issue 18), side by side in one run:

1. Saturation: requests straight to the pair, closed loop at growing concurrency. The knee
   (the smallest concurrency within ``KNEE_FRACTION`` of the best throughput) is what
   ``queue_in_flight_per_pair`` defaults to; the latency point (the most in flight whose p50
   stays within ``LATENCY_FACTOR`` of one alone), ``queue_in_flight_per_pair_contended``.
2. Noisy neighbour: tenant B at 1 in flight alone, then while tenant A keeps 24 and 64 in
   flight, through gateways whose queue cap is the knee (with each ``BENCH_FAIR_CONTENDED`` cap
   while tenants contend, default 1,2,4) and through one without a queue. Targets: B's p50
   under A within 2x of alone; the pool's throughput with the queue >= 90 % of without.
3. Weights: tenants of weight 2 and 1, both flooding, served 2 : 1 (+-15 %).

Also BENCH_FAIR_SECONDS (each timed window, default 12), BENCH_FAIR_CAP (a cap instead of the
knee), BENCH_FAIR_SWEEP=0 (with a cap given: no sweep). Alone: ``BENCH_SECTIONS=fair
scripts/bench``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import yaml

from bench.config import BenchConfig
from bench.processes import start_gateway
from bench.real_engine_bench import MODEL, pair_policies, real_pair, too_little_memory
from bench.stream_client import RunResult, Target, described, run_load, run_pd_direct
from gateway.dev.cluster import PDCluster
from gateway.dev.harness import GatewayProcess

MAX_TOKENS = 16
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": False}
SWEEP = (1, 2, 4, 6, 8, 12, 16, 24, 32)
KNEE_FRACTION = 0.95
LATENCY_FACTOR = 2.0
NO_QUEUE_CAP = 1_000_000  # above any engine's max_running_requests: nothing ever queues
TENANTS = {"tenant-a": {}, "tenant-b": {}, "heavy": {"weight": 2}, "light": {"weight": 1}}
Gateway = tuple[GatewayProcess, dict[str, str]]  # a gateway and its tenants' keys


def knee(points: list[dict], fraction: float = KNEE_FRACTION) -> int:
    """The smallest concurrency whose throughput is within ``fraction`` of the best."""
    best = max(point["rps"] for point in points)
    return min(point["concurrency"] for point in points if point["rps"] >= fraction * best)


def latency_point(points: list[dict], factor: float = LATENCY_FACTOR) -> int:
    """The most requests in flight whose p50 stays within ``factor`` of one alone."""
    alone = next(point["p50_ms"] for point in points if point["concurrency"] == 1)
    within = [point["concurrency"] for point in points if point["p50_ms"] <= factor * alone]
    return max(within, default=1)


def sweep(cluster: PDCluster, log=print) -> list[dict]:
    points = []
    for n in SWEEP:
        load = run_pd_direct(
            cluster.prefill_url,
            cluster.decode_url,
            cluster.bootstrap_port,
            BODY,
            concurrency=n,
            total_requests=max(24, n * 6),
        )
        s = asyncio.run(load).summary()
        points.append({"concurrency": n, "rps": s["rps"], "p50_ms": s["total_p50_ms"]})
        points[-1]["errors"] = s["non_200"]
        log("  saturation: " + described(points[-1]))
    return points


@contextlib.contextmanager
def gateway_with_cap(
    cluster: PDCluster, work_dir: Path, port: int, cap: int, contended: int | None
) -> Iterator[Gateway]:
    policies, _ = pair_policies(cluster, work_dir / "policies")
    tenants = yaml.safe_load((policies / "tenants.yaml").read_text())
    (policies / "tenants.yaml").write_text(yaml.safe_dump(tenants | {"tenants": TENANTS}))
    # Long enough that no queued request of the floods is refused: the bench measures
    # shares and throughput, not the bound on waiting (tests/verification/test_fair_share.py).
    env = {"ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR": str(cap), "ISOGATE_QUEUE_MAX_WAIT_S": "120"}
    if contended is not None:
        env["ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR_CONTENDED"] = str(contended)
    gateway, _ = start_gateway(policies, work_dir / "gateway", port, cpus=None, env=env)
    try:
        yield gateway, {tenant: gateway.create_tenant(tenant)[1] for tenant in TENANTS}
    finally:
        gateway.stop()


def _load(gateway: Gateway, tenant: str, in_flight: int, seconds: float, warm: int = 0):
    process, keys = gateway
    auth = (("Authorization", f"Bearer {keys[tenant]}"),)
    target = Target(process.url + "/v1/completions", orjson.dumps(BODY), auth)
    return run_load(target, concurrency=in_flight, duration_s=seconds, warmup_requests=warm)


async def _b_while_a(
    gateway: Gateway, a_in_flight: int, seconds: float
) -> tuple[RunResult, RunResult | None]:
    """B at 1 in flight for ``seconds``, inside a window where A keeps ``a_in_flight`` going."""
    if a_in_flight == 0:
        return await _load(gateway, "tenant-b", 1, seconds, warm=2), None

    async def b_inside() -> RunResult:
        await asyncio.sleep(seconds / 4)  # A's connections are up and saturating by then
        return await _load(gateway, "tenant-b", 1, seconds)

    a, b = await asyncio.gather(
        _load(gateway, "tenant-a", a_in_flight, seconds * 1.5, 1), b_inside()
    )
    return b, a


def noisy_neighbour(gateways: dict[str, Gateway], seconds: float, log=print) -> list[dict]:
    """Each load with every gateway in turn, cell by cell: on a shared host the load of the
    machine drifts, and interleaving puts the compared cells as close in time as they can be."""
    cells = []
    for a_in_flight in (0, 24, 64):
        for name, gateway in gateways.items():
            b, a = asyncio.run(_b_while_a(gateway, a_in_flight, seconds))
            bs = b.summary()
            total_rps, errors = bs["rps"], bs["non_200"]
            if a is not None:  # A's throughput, plus B's requests in the same window
                total_rps = a.summary()["rps"] + bs["requests"] / a.wall_s
                errors += a.summary()["non_200"]
            cells.append(
                {
                    "gateway": name,
                    "a_in_flight": a_in_flight,  # 0: B alone
                    "b_requests": bs["requests"],
                    "b_p50_ms": bs["total_p50_ms"],
                    "b_p99_ms": bs["total_p99_ms"],
                    "total_rps": total_rps,
                    "errors": errors,
                }
            )
            log("  " + described(cells[-1]))
    return cells


def served_counts(gateway: GatewayProcess) -> dict[str, float]:
    """Requests each tenant was served by the gateway's queues (its /metrics), so far."""
    admin = {"Authorization": f"Bearer {gateway.admin_key}"}
    counts: dict[str, float] = {}
    for line in httpx.get(gateway.url + "/metrics", headers=admin, timeout=30).text.splitlines():
        if line.startswith("isogate_queue_served_total{"):
            series, value = line.rsplit(" ", 1)
            tenant = series.split('tenant="', 1)[1].split('"', 1)[0]
            counts[tenant] = counts.get(tenant, 0.0) + float(value)
    return counts


def weights(name: str, gateway: Gateway, seconds: float, log=print) -> dict:
    """Both tenants at 24 in flight for ``2 * seconds``; the shares are what the queue served
    between a third of the way in (both long backlogged) and just before the end, so that
    neither the first slots (taken in arrival order, before anyone waits) nor the last count."""
    duration = 2 * seconds

    async def both() -> tuple[RunResult, RunResult, dict[str, float]]:
        loads = asyncio.gather(*(_load(gateway, t, 24, duration) for t in ("heavy", "light")))
        await asyncio.sleep(duration / 3)
        first = await asyncio.to_thread(served_counts, gateway[0])
        await asyncio.sleep(duration * 0.6)
        last = await asyncio.to_thread(served_counts, gateway[0])
        heavy, light = await loads
        return heavy, light, {t: last.get(t, 0.0) - first.get(t, 0.0) for t in ("heavy", "light")}

    heavy, light, window = asyncio.run(both())
    completed = {"heavy": len(heavy.ok()), "light": len(light.ok())}
    ratio = window["heavy"] / window["light"] if window["light"] else float("inf")
    errors = sum(run.errors + run.summary()["non_200"] for run in (heavy, light))
    result = {"served": window, "completed": completed, "ratio": ratio, "errors": errors}
    log(f"  {name} weights 2:1, both at 24 in flight: " + described(result))
    return result


def targets(result: dict) -> dict[str, dict[str, bool]]:
    """Each target of issue 18, met or not, for each queue gateway of one run."""
    cells = {(c["gateway"], c["a_in_flight"]): c for c in result.get("neighbour", [])}
    met: dict[str, dict[str, bool]] = {}
    for name in (name for name, a in cells if a == 0 and name != "no queue"):
        row = met.setdefault(name, {})
        for a_in_flight in (24, 64):
            queued, free = cells.get((name, a_in_flight)), cells.get(("no queue", a_in_flight))
            if queued:
                alone = cells[(name, 0)]["b_p50_ms"]
                row[f"B p50, A at {a_in_flight}, ≤ 2× alone"] = queued["b_p50_ms"] <= 2 * alone
            if queued and free:
                enough = queued["total_rps"] >= 0.9 * free["total_rps"]
                row[f"pool req/s, A at {a_in_flight}, ≥ 90 % of no queue"] = enough
        if weighed := result.get("weights", {}).get(name):
            row["weights 2:1 served 2:1 ±15 %"] = abs(weighed["ratio"] - 2) <= 0.3
    return met


def run_fair_share_bench(config: BenchConfig, work_dir: Path, log=print) -> dict:
    if why := too_little_memory():
        return {"skipped": why}
    seconds = float(os.environ.get("BENCH_FAIR_SECONDS", 12))
    given = os.environ.get("BENCH_FAIR_CAP")
    run_sweep = os.environ.get("BENCH_FAIR_SWEEP", "1") != "0" or given is None
    contended = [int(c) for c in os.environ.get("BENCH_FAIR_CONTENDED", "1,2,4").split(",") if c]
    try:
        with (
            real_pair(config, work_dir / "sglang-fair", log) as cluster,
            contextlib.ExitStack() as up,
        ):
            points = sweep(cluster, log) if run_sweep else []
            measured = knee(points) if points else None
            cap = int(given) if given is not None else int(measured or 1)
            within = latency_point(points) if points else None
            log(f"  knee (>= {KNEE_FRACTION:.0%} of the best throughput): {measured}; cap {cap}")
            log(f"  most in flight with p50 <= {LATENCY_FACTOR:g}x alone: {within}")
            variants = {"queue": (cap, None), **{f"queue c={c}": (cap, c) for c in contended}}
            variants["no queue"] = (NO_QUEUE_CAP, None)
            # Every gateway up at once (an idle one costs the pair nothing), on its own port.
            gateways = {
                name: up.enter_context(
                    gateway_with_cap(
                        cluster,
                        work_dir / f"fair-{name.replace(' ', '-').replace('=', '')}",
                        config.ports.real_gateway + offset,
                        *caps,
                    )
                )
                for offset, (name, caps) in enumerate(variants.items())
            }
            result: dict = {"sweep": points, "knee": measured, "latency_point": within, "cap": cap}
            result |= {"contended": contended, "seconds": seconds, "max_tokens": MAX_TOKENS}
            result["neighbour"] = noisy_neighbour(gateways, seconds, log)
            result["weights"] = {
                name: weights(name, gateway, seconds, log)
                for name, gateway in gateways.items()
                if name != "no queue"
            }
        result["targets"] = targets(result)
        for name, row in result["targets"].items():
            log(
                f"  {name}: "
                + "; ".join(f"{t}: {'met' if ok else 'MISSED'}" for t, ok in row.items())
            )
        return result
    except Exception as exc:  # reported; the gateways and the pair are stopped on the way out
        log(f"  fair-share run failed: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
