"""What each step of the request path costs, by taking it out: in process, A/B alternating.

The gateway app runs in this process (no uvicorn: requests are ASGI calls, 16 in flight)
against the instant backends on the other CPU, and this process is pinned like the gateway
in the suite. Each variant takes one step out (or puts an old implementation back) in
alternating slices of requests, A (as shipped) then B (the variant), so a noisy neighbour
hits both; the figure is the median difference in CPU per request. Sampling profilers
misattribute here (time waiting for the GIL, cold caches after other work); removing a
step and measuring is what says what it costs.

    .venv/bin/python -m bench.pipeline_costs [--rounds 8] [--stream] [VARIANT ...]

Variants: no_tokenizer (prompt ids served from a cache), no_audit, no_metrics, no_limits
(both stages of the tenant's limits), no_fair_queue (every request finds its slot at once, as
with no queue), served_line (a served request's log line written, as it was at INFO before),
audit_from_thread (the SQLite insert from a worker thread, as before), unbatched_tokenizer
(one encode per request, as before), starlette_task_group (streams pumped by Starlette's
StreamingResponse task group, as the gateway's are not), async_exit_stack (a request's claims
held in contextlib.AsyncExitStack instead of gateway.core.held.Held).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.processes import BenchModel, BenchPool, instant_backend, write_bench_policies
from bench.rig import INSTANT_GATEWAY_ENV, MODEL, POOL_TOKENS
from bench.routing_bench import request_body
from gateway.dev.model import ensure_tiny_model

IN_FLIGHT = 16
SLICE = 1600  # requests per A or B slice


# -- variants: each returns the function that undoes it --------------------------------------


def no_tokenizer(components: Any) -> Callable[[], None]:
    import gateway.openai.tokenize as tokenize

    original = tokenize.ModelTokenizer._encode
    cache: dict[tuple[str, bool], list[int]] = {}

    async def cached(self, text: str, *, add_special_tokens: bool) -> list[int]:  # type: ignore[no-untyped-def]
        key = (text, add_special_tokens)
        if key not in cache:
            cache[key] = await original(self, text, add_special_tokens=add_special_tokens)
        return list(cache[key])

    tokenize.ModelTokenizer._encode = cached  # type: ignore[method-assign]
    return lambda: setattr(tokenize.ModelTokenizer, "_encode", original)


def unbatched_tokenizer(components: Any) -> Callable[[], None]:
    import gateway.openai.tokenize as tokenize

    original = tokenize.ModelTokenizer._encode

    async def one_by_one(self, text: str, *, add_special_tokens: bool) -> list[int]:  # type: ignore[no-untyped-def]
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[
            0
        ].ids

    tokenize.ModelTokenizer._encode = one_by_one  # type: ignore[method-assign]
    return lambda: setattr(tokenize.ModelTokenizer, "_encode", original)


def no_audit(components: Any) -> Callable[[], None]:
    record = components.audit.record
    components.audit.record = lambda event: None
    return lambda: setattr(components.audit, "record", record)


def audit_from_thread(components: Any) -> Callable[[], None]:
    writer = components.audit._sqlite
    components.audit._sqlite = None  # the audit log then inserts through asyncio.to_thread
    return lambda: setattr(components.audit, "_sqlite", writer)


def served_line(components: Any) -> Callable[[], None]:
    logger = logging.getLogger("isogate.request")
    logger.setLevel(logging.DEBUG)  # served requests log at DEBUG; the root handler writes all
    return lambda: logger.setLevel(logging.NOTSET)


def no_metrics(components: Any) -> Callable[[], None]:
    observe = components.metrics.observe_request
    components.metrics.observe_request = lambda *args: None
    return lambda: setattr(components.metrics, "observe_request", observe)


def no_limits(components: Any) -> Callable[[], None]:
    """The tenant's limits taken out: both stages (``enter`` as the request's key is known,
    ``reserve`` once its tokens are) and the one-stage ``acquire`` hand out a lease that counts
    nothing and sends no rate-limit headers."""

    class Lease:
        left = None

        async def reserve(self, tokens: int) -> None:
            pass

        async def settle(self, tokens: int) -> None:
            pass

        async def release(self) -> None:
            pass

        def header_lines(self) -> bytes:
            return b""

    limiter = components.limiter
    enter, acquire = limiter.enter, limiter.acquire

    async def free(*args: object) -> Lease:
        return Lease()

    limiter.enter = limiter.acquire = free

    def undo() -> None:
        limiter.enter, limiter.acquire = enter, acquire

    return undo


def no_fair_queue(components: Any) -> Callable[[], None]:
    """The pair's fair queue taken out: every request finds a slot at once, and its release
    does nothing (what the queue costs a request that does not wait)."""

    class Slot:
        def release(self) -> None:
            pass

    queues = components.queues
    take_free = queues.take_free
    queues.take_free = lambda *args: Slot()
    return lambda: setattr(queues, "take_free", take_free)


def starlette_task_group(components: Any) -> Callable[[], None]:
    """Streams pumped by Starlette's own ``StreamingResponse.__call__`` (an anyio task group)
    instead of in the request's own task under ``ClientWatch``
    (``GuardedStream._pump_until_disconnected``)."""
    from starlette.responses import StreamingResponse

    from gateway.api.pipeline import GuardedStream

    original = GuardedStream._pump_until_disconnected

    async def task_group(self: GuardedStream, scope: Any, receive: Any, send: Any) -> None:
        await StreamingResponse.__call__(self, {"type": "http"}, receive, send)

    GuardedStream._pump_until_disconnected = task_group  # type: ignore[method-assign]
    return lambda: setattr(GuardedStream, "_pump_until_disconnected", original)


def async_exit_stack(components: Any) -> Callable[[], None]:
    """What a request holds kept in ``contextlib.AsyncExitStack``, as the generation core first
    did, instead of ``gateway.core.held.Held`` (the lease's release pushed as an async callback, the
    others as callbacks; telling them apart is one ``isinstance``)."""
    import contextlib

    import gateway.api.pipeline as pipeline
    from gateway.tenancy.limits import LimitLease

    class StackHeld(contextlib.AsyncExitStack):
        def push(self, release: Any) -> None:  # type: ignore[override]
            if isinstance(getattr(release, "__self__", None), LimitLease):
                self.push_async_callback(release)
            else:
                self.callback(release)

    original = pipeline.Held
    pipeline.Held = StackHeld  # type: ignore[misc,assignment]
    return lambda: setattr(pipeline, "Held", original)


VARIANTS: dict[str, Callable[[Any], Callable[[], None]]] = {
    f.__name__: f
    for f in (
        no_tokenizer,
        no_audit,
        served_line,
        no_metrics,
        no_limits,
        no_fair_queue,
        audit_from_thread,
        unbatched_tokenizer,
        starlette_task_group,
        async_exit_stack,
    )
}


# -- the harness ---------------------------------------------------------------------------


class InProcessGateway:
    """The ASGI app with its lifespan run by hand; requests are direct ASGI calls."""

    def __init__(self, app: Any, stream: bool) -> None:
        self.app = app
        self.body = request_body(stream)
        self._lifespan: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self._started = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._headers: list[tuple[bytes, bytes]] = []

    async def start(self) -> None:
        async def receive() -> dict[str, str]:
            return await self._lifespan.get()

        async def send(message: dict[str, str]) -> None:
            if message["type"] == "lifespan.startup.complete":
                self._started.set()

        await self._lifespan.put({"type": "lifespan.startup"})
        self._task = asyncio.create_task(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
        )
        await asyncio.wait_for(self._started.wait(), 60)
        components = self.app.state.components
        for _ in range(100):
            if all(components.capacity.get(url) for url, _ in components.workers()):
                break
            await asyncio.sleep(0.1)
        components.store.migrate()
        components.store.create_tenant("bench-tenant")
        key, _ = components.store.create_key("bench-tenant")
        self._headers = [
            (b"host", b"gateway"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.body)).encode()),
        ]

    async def stop(self) -> None:
        await self._lifespan.put({"type": "lifespan.shutdown"})
        if self._task is not None:
            await self._task

    async def request(self) -> None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": self._headers,
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "server": ("gateway", 80),
            "client": ("127.0.0.1", 1),
            "http_version": "1.1",
            "asgi": {"version": "3.0"},
        }
        sent_body = False
        loop = asyncio.get_running_loop()

        async def receive() -> dict[str, object]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            # The client stays connected. A future of each call's own: the gateway cancels the
            # calls it gave up on, and a shared one would be cancelled for all of them.
            await loop.create_future()
            raise AssertionError("unreachable")

        status: list[int] = []

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])  # type: ignore[arg-type]

        await self.app(scope, receive, send)
        if status != [200]:
            raise RuntimeError(f"the gateway answered {status}")

    async def cpu_per_request(self, requests: int) -> float:
        async def client(count: int) -> None:
            for _ in range(count):
                await self.request()

        started = time.process_time()
        await asyncio.gather(*(client(requests // IN_FLIGHT) for _ in range(IN_FLIGHT)))
        return (time.process_time() - started) / requests * 1e6


async def measure(variants: list[str], rounds: int, stream: bool) -> list[dict[str, float | str]]:
    from gateway.api.app import create_app
    from gateway.config.settings import Settings
    from gateway.observability.logs import configure_logging

    settings = Settings()
    configure_logging(settings)
    # The log handler writes to /dev/null for the rest of the process, so it stays open; opening
    # /dev/null does not block the loop (and nothing else runs on it yet).
    devnull = open(os.devnull, "w")  # noqa: ASYNC230, SIM115
    logging.getLogger().handlers[0].stream = devnull  # type: ignore[attr-defined]
    gateway = InProcessGateway(create_app(settings), stream)
    await gateway.start()
    rows: list[dict[str, float | str]] = []
    try:
        await gateway.cpu_per_request(SLICE)  # warm-up
        components = gateway.api.app.state.components
        for name in variants:
            shipped, variant = [], []
            for _ in range(rounds):
                shipped.append(await gateway.cpu_per_request(SLICE))
                undo = VARIANTS[name](components)
                try:
                    variant.append(await gateway.cpu_per_request(SLICE))
                finally:
                    undo()
            a, b = statistics.median(shipped), statistics.median(variant)
            rows.append(
                {
                    "variant": name,
                    "shipped_us": round(a, 1),
                    "variant_us": round(b, 1),
                    "difference_us": round(b - a, 1),
                }
            )
            print(
                f"{name:22} shipped {a:6.0f} µs/req   {name} {b:6.0f} µs/req   "
                f"difference {b - a:+5.0f} µs",
                flush=True,
            )
    finally:
        await gateway.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "variants",
        nargs="*",
        metavar="VARIANT",
        help=f"any of {', '.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    args.variants = args.variants or list(VARIANTS)
    config = BenchConfig.from_env()
    work = Path(tempfile.mkdtemp(prefix="isogate-pipeline-costs-"))
    ports = config.ports
    backends = [
        instant_backend(role, port, work, cpus=config.helper_cpus, pool_tokens=POOL_TOKENS)
        for role, port in (("prefill", ports.prefill), ("decode", ports.decode))
    ]
    try:
        pool = BenchPool(
            f"http://127.0.0.1:{backends[0].port}",
            ports.bootstrap,
            f"http://127.0.0.1:{backends[1].port}",
        )
        policies = write_bench_policies(
            work / "policies",
            tokenizer_dir=ensure_tiny_model(),
            models=[BenchModel(MODEL, 65_536, pool)],
        )
        if config.router_cpus:
            os.sched_setaffinity(0, config.router_cpus)  # as the suite pins the gateway
        os.environ.update(
            ISOGATE_POLICIES_DIR=str(policies),
            ISOGATE_DATABASE_URL=f"sqlite:///{work}/isogate.db",
            ISOGATE_AUDIT_SPOOL_DIR=str(work / "audit-spool"),
            ISOGATE_ADMIN_KEY="bench-admin-key-0123",
            # As the other benches run the gateway: the queue's cap above the load (see
            # ``bench.rig``), so no variant measures requests waiting their turn.
            **INSTANT_GATEWAY_ENV,
        )
        import uvloop

        rows = uvloop.run(measure(args.variants, args.rounds, args.stream))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
    finally:
        for backend in backends:
            backend.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
