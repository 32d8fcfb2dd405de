"""Fair share on a real SGLang PD pair on the CPU, as a tenant sees it (issues 18 and 42).

1. Saturation: requests straight to the pair, closed loop at growing concurrency. The knee
   (the smallest concurrency within ``KNEE_FRACTION`` of the best throughput) is the pair's
   cap (``queue_in_flight_per_pair``).
2. Noisy neighbour: tenant B sends one request at a time (``max_tokens`` 16, then 64) alone,
   then while tenant A keeps 24 and 64 requests in flight at ``max_tokens`` 64 and 1,024, and
   while A sends one request of 32 prompts x ``n=16`` at a time, and one streamed request of
   1,024 tokens with 5 log probabilities per token at a time; through a gateway with the
   queue as configured (the settings' defaults, the knee as its cap) and through one without
   a queue. For each case: B's p50 against B alone through the same gateway, B's refused
   requests, and the pair's generated tokens per second against the same case without a
   queue. Targets (issue 42, CPU): B's p50 <= 2.5x alone, B never refused, throughput >= 80 %
   of no queue.
3. The curve the defaults are chosen from: B (16 tokens) while A keeps 24 in flight at 64
   tokens, through gateways whose contended cap is each of ``BENCH_FAIR_CONTENDED`` (default
   1,2,4,8, and the cap): B's ratio against the throughput.
4. The contention linger: B with a pause of ``THINK_S`` between its requests (a tenant at one
   request in flight is not sending all the time) while A keeps 24 in flight at 1,024 tokens,
   through gateways lingering each of ``BENCH_FAIR_LINGER`` seconds (default 1,10).
5. Weights: tenants of weight 2 and 1, both flooding, served 2 : 1 (+-15 %).

The pair's throughput is what its decode worker logs as ``gen throughput`` (generated tokens
per second, every 40 decode steps), averaged over B's window: requests of 1,024 tokens do not
end inside one, and the workers' /metrics answered empty on the CPU pair.
Every request sends ``ignore_eos`` so that it is as long as it says.

Also BENCH_FAIR_SECONDS (B's window in each case, default 15), BENCH_FAIR_CAP (a cap instead
of the knee), BENCH_FAIR_SWEEP=0 (with a cap given: no sweep), BENCH_FAIR_PARTS (default
neighbour,curve,linger,weights), BENCH_FAIR_COMPARE (contended caps, e.g. 2,4: the
noisy neighbour through a queue at each, side by side, instead of the configured one). A run
whose pair stops transferring KV (``PairDied``) fails
rather than report what it measured after. Alone:
``BENCH_SECTIONS=fair scripts/bench``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import yaml

from bench.config import BenchConfig
from bench.processes import start_gateway
from bench.real_engine_bench import MODEL, pair_policies, real_pair, too_little_memory
from bench.stream_client import (
    CLIENT_ERRORS,
    Connection,
    RunResult,
    Sample,
    Target,
    described,
    percentile,
    run_load,
    run_pd_direct,
)
from gateway.dev.cluster import PDCluster
from gateway.dev.harness import GatewayProcess

MAX_TOKENS = 16  # the saturation sweep's requests
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": False}
SWEEP = (1, 2, 4, 6, 8, 12, 16, 24, 32)
KNEE_FRACTION = 0.95
NO_QUEUE_CAP = 1_000_000  # above any engine's max_running_requests: nothing ever queues
B_MAX_TOKENS = (16, 64)
# (label, A's requests in flight, A's body fields)
A_CASES: tuple[tuple[str, int, dict], ...] = (
    ("24 x 64 tok", 24, {"max_tokens": 64}),
    ("64 x 64 tok", 64, {"max_tokens": 64}),
    ("24 x 1024 tok", 24, {"max_tokens": 1024}),
    ("64 x 1024 tok", 64, {"max_tokens": 1024}),
    (
        "1 x 32 prompts x n=16",
        1,
        {"prompt": [[3 + (7 * p + i) % 500 for i in range(8)] for p in range(32)], "n": 16},
    ),
    # One long stream with log probabilities: each chunk must cost what it adds, not what the
    # stream holds so far (SGLang repeats it all without --incremental-streaming-output).
    ("1 x 1024 tok streamed, logprobs 5", 1, {"max_tokens": 1024, "stream": True, "logprobs": 5}),
)
CURVE_CASE = ("24 x 64 tok", 24, {"max_tokens": 64})
LINGER_CASE = ("24 x 1024 tok", 24, {"max_tokens": 1024})
THINK_S = 2.0
RAMP_S = 4.0  # A's flood runs this long before B's window opens
# Issue 42's targets on the CPU pair.
B_RATIO_TARGET = 2.5
THROUGHPUT_TARGET = 0.8
LIMITS = {"requests_per_minute": 10**8, "tokens_per_minute": 10**12, "max_concurrent": 10**6}
TENANTS = {
    "tenant-a": {"limits": LIMITS},
    "tenant-b": {"limits": LIMITS},
    "heavy": {"weight": 2, "limits": LIMITS},
    "light": {"weight": 1, "limits": LIMITS},
}
Gateway = tuple[GatewayProcess, dict[str, str]]  # a gateway and its tenants' keys


def knee(points: list[dict], fraction: float = KNEE_FRACTION) -> int:
    """The smallest concurrency whose throughput is within ``fraction`` of the best."""
    best = max(point["rps"] for point in points)
    return min(point["concurrency"] for point in points if point["rps"] >= fraction * best)


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


@dataclass(frozen=True)
class Variant:
    """One gateway's queue settings (None: the settings' default)."""

    cap: int | None = None
    contended: int | None = None
    linger_s: float | None = None
    request_share: float | None = None

    def env(self) -> dict[str, str]:
        # Long enough that no queued request of A's floods is refused: B's refusals are what
        # is counted (the bound on waiting: tests/verification/test_fair_share.py).
        env = {"ISOGATE_QUEUE_MAX_WAIT_S": "300"}
        if self.cap is not None:
            env["ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR"] = str(self.cap)
        if self.contended is not None:
            env["ISOGATE_QUEUE_IN_FLIGHT_PER_PAIR_CONTENDED"] = str(self.contended)
        if self.linger_s is not None:
            env["ISOGATE_QUEUE_CONTENTION_LINGER_S"] = str(self.linger_s)
        return env


@contextlib.contextmanager
def gateway_with(
    cluster: PDCluster, work_dir: Path, port: int, variant: Variant
) -> Iterator[Gateway]:
    policies, _ = pair_policies(cluster, work_dir / "policies")
    tenants = yaml.safe_load((policies / "tenants.yaml").read_text())
    (policies / "tenants.yaml").write_text(yaml.safe_dump(tenants | {"tenants": TENANTS}))
    if variant.request_share is not None:
        models = yaml.safe_load((policies / "models.yaml").read_text())
        for model in models["models"]:
            for pool in model["pools"]:
                pool["max_request_share"] = variant.request_share
        (policies / "models.yaml").write_text(yaml.safe_dump(models))
    gateway, _ = start_gateway(policies, work_dir / "gateway", port, cpus=None, env=variant.env())
    try:
        yield gateway, {tenant: gateway.create_tenant(tenant)[1] for tenant in TENANTS}
    finally:
        gateway.stop()


def _target(gateway: Gateway, tenant: str, fields: dict, model: str = MODEL) -> Target:
    process, keys = gateway
    body = {"model": model, "prompt": PROMPT, "ignore_eos": True, "stream": False, **fields}
    auth = (("Authorization", f"Bearer {keys[tenant]}"),)
    return Target(process.url + "/v1/completions", orjson.dumps(body), auth)


async def _closed_loop(
    target: Target, in_flight: int, stop: asyncio.Event, samples: list[Sample], think_s: float = 0
) -> None:
    """``in_flight`` connections, each sending the next request as the last one ends (after
    ``think_s``), until ``stop``; what is in flight then is abandoned (its connection closed,
    so the gateway aborts it on the workers)."""

    async def worker() -> None:
        connection = Connection(target.url)
        try:
            while not stop.is_set():
                try:
                    samples.append(await connection.exchange(target.request_bytes()))
                except CLIENT_ERRORS:
                    await connection.close()
                    samples.append(Sample(0.0, 0.0, 599, ok=False))
                if think_s:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), think_s)
        finally:
            await connection.close()

    tasks = [asyncio.ensure_future(worker()) for _ in range(in_flight)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _gen_throughput(log_path: Path, offset: int) -> float:
    """The pair's generated tokens per second over what decode logged past ``offset``: the
    mean of its ``gen throughput`` lines (SGLang logs one every 40 decode steps; the workers'
    /metrics answered empty on the CPU pair)."""
    with log_path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    values = [float(match) for match in _THROUGHPUT.findall(text)]
    return statistics.fmean(values) if values else float("nan")


_THROUGHPUT = re.compile(r"gen throughput \(token/s\): ([0-9.]+)")
# SGLang 0.5.23's Mooncake sender thread can die on an abort that races a transfer
# (mooncake/conn.py transfer_worker: a room's status read after the abort cleared it); every
# later transfer then waits forever, and a window's figures would be noise.
_DEAD_PAIR = "Transfer thread failed"


class PairDied(RuntimeError):
    """The pair stopped transferring KV: what was measured after it means nothing."""


def _refuse_a_dead_pair(log_dir: Path) -> None:
    for log in log_dir.glob("sglang-*.log"):
        if _DEAD_PAIR in log.read_text(errors="replace"):
            raise PairDied(f"{log.name}: the KV transfer thread died ({_DEAD_PAIR})")


async def _case(
    decode_log: Path,
    gateway: Gateway,
    b_tokens: int,
    a_case: tuple[str, int, dict] | None,
    seconds: float,
    think_s: float = 0.0,
    model: str = MODEL,
    ramp_s: float = RAMP_S,
) -> dict:
    """B for ``seconds`` (after A's ramp, when A floods); B's requests are those that began
    and ended in its window."""
    a_samples: list[Sample] = []
    b_samples: list[Sample] = []
    a_stop, b_stop = asyncio.Event(), asyncio.Event()
    a_task = None
    if a_case is not None:
        a_task = asyncio.ensure_future(
            _closed_loop(
                _target(gateway, "tenant-a", a_case[2], model), a_case[1], a_stop, a_samples
            )
        )
        await asyncio.sleep(ramp_s)
    b_target = _target(gateway, "tenant-b", {"max_tokens": b_tokens}, model)
    offset = await asyncio.to_thread(os.path.getsize, decode_log)
    b_task = asyncio.ensure_future(_closed_loop(b_target, 1, b_stop, b_samples, think_s))
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    throughput = _gen_throughput(decode_log, offset)
    _refuse_a_dead_pair(decode_log.parent)
    b_stop.set()
    a_stop.set()
    await asyncio.gather(b_task, *([a_task] if a_task else []))
    wall = time.perf_counter() - started
    ok = sorted(s.total_s for s in b_samples if s.ok)
    return {
        "b_max_tokens": b_tokens,
        "a": a_case[0] if a_case else "alone",
        "b_requests": len(ok),
        "b_refused": sum(1 for s in b_samples if not s.ok),
        "b_p50_ms": percentile(ok, 0.5) * 1000,
        "b_p90_ms": percentile(ok, 0.9) * 1000,
        "a_completed": sum(1 for s in a_samples if s.ok),
        "a_refused": sum(1 for s in a_samples if not s.ok),
        "tokens_per_s": throughput,
        "window_s": wall,
    }


def warm_up(gateways: dict[str, Gateway], model: str = MODEL) -> None:
    """A few requests of each tenant through each gateway (tokenizer, connections, the pair's
    first batches) before anything is measured."""
    for gateway in gateways.values():
        for tenant in ("tenant-a", "tenant-b"):
            target = _target(gateway, tenant, {"max_tokens": 16}, model)
            asyncio.run(run_load(target, concurrency=1, total_requests=3))


def noisy_neighbour(
    decode_log: Path,
    gateways: dict[str, Gateway],
    seconds: float,
    log=print,
    model: str = MODEL,
    ramp_s: float = RAMP_S,
    cells: list[dict] | None = None,
) -> list[dict]:
    """Every case, with each gateway in turn, cell by cell (appended to ``cells`` as each is
    measured): on a shared host the load of the machine drifts, and interleaving puts the
    compared cells as close in time as they can be."""
    cells = [] if cells is None else cells
    for b_tokens in B_MAX_TOKENS:
        for a_case in (None, *A_CASES):
            for name, gateway in gateways.items():
                cell = {"gateway": name}
                cell |= asyncio.run(
                    _case(
                        decode_log, gateway, b_tokens, a_case, seconds, model=model, ramp_s=ramp_s
                    )
                )
                cells.append(cell)
                log("  " + described(cell))
    return _with_ratios(cells)


def _with_ratios(cells: list[dict]) -> list[dict]:
    """Each cell's B p50 against B alone through the same gateway, and its throughput against
    the same case through the gateway without a queue."""
    alone = {(c["gateway"], c["b_max_tokens"]): c["b_p50_ms"] for c in cells if c["a"] == "alone"}
    free = {
        (c["a"], c["b_max_tokens"]): c["tokens_per_s"] for c in cells if c["gateway"] == "no queue"
    }
    for cell in cells:
        base = alone.get((cell["gateway"], cell["b_max_tokens"]))
        cell["b_ratio"] = cell["b_p50_ms"] / base if base else float("nan")
        without = free.get((cell["a"], cell["b_max_tokens"]))
        cell["vs_no_queue"] = cell["tokens_per_s"] / without if without else float("nan")
    return cells


def curve(
    cluster: PDCluster, gateways: dict[str, Gateway], seconds: float, log=print, cells=None
) -> list[dict]:
    """B (16 tokens) alone and beside ``CURVE_CASE`` through each gateway of the curve."""
    cells = [] if cells is None else cells
    for name, gateway in gateways.items():
        for a_case in (None, CURVE_CASE):
            cell = {"gateway": name} | asyncio.run(
                _case(cluster.logs["decode"], gateway, 16, a_case, seconds)
            )
            cells.append(cell)
            log("  curve: " + described(cell))
    return _with_ratios(cells)


def linger(
    cluster: PDCluster, gateways: dict[str, Gateway], seconds: float, log=print, cells=None
) -> list[dict]:
    """B pausing ``THINK_S`` between its requests, alone and beside ``LINGER_CASE``."""
    cells = [] if cells is None else cells
    for name, gateway in gateways.items():
        for a_case in (None, LINGER_CASE):
            cell = {"gateway": name, "think_s": THINK_S}
            cell |= asyncio.run(
                _case(cluster.logs["decode"], gateway, 16, a_case, 2 * seconds, THINK_S)
            )
            cells.append(cell)
            log("  linger: " + described(cell))
    return _with_ratios(cells)


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
    """Both tenants at 24 in flight (requests of the same size: grants served 2 : 1 are tokens
    served 2 : 1) for ``2 * seconds``; the shares are what the queue served between a third of
    the way in (both long backlogged) and just before the end."""
    duration = 2 * seconds

    def load(tenant: str):
        target = _target(gateway, tenant, {"max_tokens": MAX_TOKENS})
        return run_load(target, concurrency=24, duration_s=duration)

    async def both() -> tuple[RunResult, RunResult, dict[str, float]]:
        loads = asyncio.gather(*(load(t) for t in ("heavy", "light")))
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


def targets(
    result: dict, ratio: float = B_RATIO_TARGET, throughput: float = THROUGHPUT_TARGET
) -> dict[str, dict[str, bool]]:
    """Issue 42's targets (on the CPU pair by default), met or not, for each case through the
    queue."""
    met: dict[str, dict[str, bool]] = {}
    for cell in result.get("neighbour", []):
        if cell["gateway"] == "no queue" or cell["a"] == "alone":
            continue
        gateway = "" if cell["gateway"] == "queue" else f"{cell['gateway']}: "
        row = met.setdefault(f"{gateway}B {cell['b_max_tokens']:g} tok, A {cell['a']}", {})
        row[f"B p50 <= {ratio:g}x alone"] = cell["b_ratio"] <= ratio
        row["B never refused"] = cell["b_refused"] == 0
        row[f"tokens/s >= {throughput:.0%} of no queue"] = cell["vs_no_queue"] >= throughput
    if weighed := result.get("weights", {}).get("queue"):
        met["weights"] = {"2:1 served 2:1 +-15 %": abs(weighed["ratio"] - 2) <= 0.3}
    return met


def run_fair_share_bench(config: BenchConfig, work_dir: Path, log=print) -> dict:
    if why := too_little_memory():
        return {"skipped": why}
    seconds = float(os.environ.get("BENCH_FAIR_SECONDS", 15))
    given = os.environ.get("BENCH_FAIR_CAP")
    run_sweep = os.environ.get("BENCH_FAIR_SWEEP", "1") != "0" or given is None
    contended = [int(c) for c in os.environ.get("BENCH_FAIR_CONTENDED", "1,2,4,8").split(",") if c]
    lingers = [float(s) for s in os.environ.get("BENCH_FAIR_LINGER", "1,10").split(",") if s]
    parts = set(os.environ.get("BENCH_FAIR_PARTS", "neighbour,curve,linger,weights").split(","))
    try:
        with (
            real_pair(config, work_dir / "sglang-fair", log) as cluster,
            contextlib.ExitStack() as up,
        ):
            points = sweep(cluster, log) if run_sweep else []
            measured = knee(points) if points else None
            cap = int(given) if given is not None else int(measured or 12)
            log(f"  knee (>= {KNEE_FRACTION:.0%} of the best throughput): {measured}; cap {cap}")
            ports = iter(range(config.ports.real_gateway, config.ports.real_gateway + 100))

            def up_gateway(name: str, variant: Variant) -> Gateway:
                work = work_dir / f"fair-{name.replace(' ', '-').replace('=', '')}"
                return up.enter_context(gateway_with(cluster, work, next(ports), variant))

            # The queue as configured, or side by side at each of BENCH_FAIR_COMPARE's
            # contended caps (cell by cell, at the same moments of a drifting host).
            compare = [int(c) for c in os.environ.get("BENCH_FAIR_COMPARE", "").split(",") if c]
            main = (
                {"queue": up_gateway("queue", Variant(cap=cap))}
                if not compare
                else {f"contended={c}": up_gateway(f"n{c}", Variant(cap, c)) for c in compare}
            )
            main["no queue"] = up_gateway(
                "no queue", Variant(NO_QUEUE_CAP, NO_QUEUE_CAP, request_share=1.0)
            )
            result: dict = {"sweep": points, "knee": measured, "cap": cap, "seconds": seconds}
            result |= {"b_max_tokens": B_MAX_TOKENS, "ramp_s": RAMP_S, "think_s": THINK_S}
            warm_up(main)
            try:
                measure(cluster, main, up_gateway, result, parts, (contended, lingers), log)
            except PairDied as died:  # what was measured before it stands
                log(f"  the pair died: {died}")
                result["pair_died"] = str(died)
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


def measure(
    cluster: PDCluster,
    main: dict[str, Gateway],
    up_gateway: Callable[[str, Variant], Gateway],
    result: dict,
    parts: set[str],
    variants: tuple[list[int], list[float]],
    log=print,
) -> None:
    """The parts asked for, into ``result``."""
    seconds, cap = result["seconds"], result["cap"]
    contended, lingers = variants
    for part in ("neighbour", "curve", "linger"):  # cells kept as measured, whatever happens
        if part in parts:
            result[part] = []
    try:
        if "neighbour" in parts:
            decode_log = cluster.logs["decode"]
            noisy_neighbour(decode_log, main, seconds, log, cells=result["neighbour"])
        if "curve" in parts:
            caps = sorted({c for c in contended if c < cap} | {cap})
            by_cap = {f"contended={c}": up_gateway(f"c{c}", Variant(cap, c)) for c in caps}
            warm_up(by_cap)
            by_cap["no queue"] = main["no queue"]
            curve(cluster, by_cap, seconds, log, cells=result["curve"])
        if "linger" in parts:
            by_linger = {
                f"linger={s:g}": up_gateway(f"l{s:g}", Variant(cap, linger_s=s)) for s in lingers
            }
            warm_up(by_linger)
            linger(cluster, by_linger, seconds, log, cells=result["linger"])
    finally:
        for part in ("neighbour", "curve", "linger"):
            _with_ratios(result.get(part, []))
    if "weights" in parts:
        name = next(iter(main))
        result["weights"] = {"queue": weights(name, main[name], seconds, log)}
