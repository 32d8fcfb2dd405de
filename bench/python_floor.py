"""The floor of a PD proxy in Python on the gateway's own stack, measured beside the gateway.

Why: the CPU-per-request target (≤ 2× ``sglang_router``) asks whether the gateway's own work
is what costs. This measures a proxy that does none of it: a bare ASGI app on the same uvicorn
(uvloop + httptools) that reads the body and sends it to prefill and decode with the
gateway's own upstream client (``gateway.workers.upstream``), both in flight together as
``gateway.workers.dispatch`` does, and returns decode's answer. No Starlette, no auth, tokenizer,
admission, limits, verification, audit, metrics or logs. Whatever it costs per request, no
Python gateway on this stack can cost less, and the gateway's cost above it is its own work.

    python -m bench.python_floor [--seconds 6]

Same pinning as the suite's routing section: the proxy alone on the last CPU, wrk and the
instant backends on the others. Prints one JSON line per concurrency: req/s, p50/p99, CPU µs
per request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.processes import Managed, cpu_seconds, free_ports, instant_backend, wait_http
from bench.wrk import run_wrk

_CPUS = sorted(os.sched_getaffinity(0))
# As the suite pins the routers: the proxy alone on the last CPU, everything else on the rest.
PROXY_CPUS = {_CPUS[-1]} if len(_CPUS) >= 2 else None
HELPER_CPUS = set(_CPUS[:-1]) if len(_CPUS) >= 2 else None


async def _app_factory(prefill: str, decode: str):  # type: ignore[no-untyped-def]
    from gateway.workers.upstream import UpstreamClient

    client = UpstreamClient(connect_timeout_s=2.0, timeout_s=30.0)
    headers = {"Content-Type": "application/json"}

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        # As gateway.workers.dispatch sends a request to its pair: both in flight, awaited together.
        exchanges = [
            await client.send(f"{prefill}/generate", body, headers),
            await client.send(f"{decode}/generate", body, headers),
        ]
        try:
            await client.wait_for_answers(exchanges)
            status, answer = exchanges[1].status, exchanges[1].body()
        finally:
            for exchange in exchanges:
                client.finish(exchange)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(answer)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    return app


def serve(port: int, prefill: str, decode: str) -> None:
    import uvicorn

    async def main() -> None:
        app = await _app_factory(prefill, decode)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            lifespan="off",
        )
        await uvicorn.Server(config).serve()

    import uvloop

    uvloop.run(main())


def measure(seconds: float, work_dir: Path) -> list[dict[str, float]]:
    prefill = instant_backend(
        "prefill", free_ports(34150), work_dir, cpus=HELPER_CPUS, pool_tokens=8_388_608
    )
    decode = instant_backend(
        "decode", free_ports(34160), work_dir, cpus=HELPER_CPUS, pool_tokens=8_388_608
    )
    port = free_ports(34170)
    proxy = Managed(
        "python-floor",
        [
            sys.executable,
            "-m",
            "bench.python_floor",
            "--serve",
            str(port),
            f"http://127.0.0.1:{prefill.port}",
            f"http://127.0.0.1:{decode.port}",
        ],
        work_dir / "python-floor.log",
        PROXY_CPUS,
    ).start()
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, proxy.process, proxy.log_path)
        # The SGLang /generate body the gateway sends for the suite's short prompt (4 output
        # tokens).
        body = json.dumps(
            {
                "input_ids": list(range(1, 40)),
                "sampling_params": {"max_new_tokens": 4},
                "rid": "gen_floor",
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": 1,
                "bootstrap_room": 7,
                "stream": False,
            }
        ).encode()
        url = f"http://127.0.0.1:{port}/generate"
        run_wrk(url, body, connections=4, duration_s=1, cpus=HELPER_CPUS)  # warm-up
        for connections in (1, 16, 64):
            before = cpu_seconds(proxy.pid)
            result = run_wrk(
                url, body, connections=connections, duration_s=seconds, cpus=HELPER_CPUS
            )
            used = cpu_seconds(proxy.pid) - before
            rows.append(
                {
                    "in_flight": connections,
                    "rps": result.requests / result.duration_s,
                    "p50_ms": result.p50_ms,
                    "p99_ms": result.p99_ms,
                    "errors": result.errors,
                    "cpu_us_per_request": used / max(1, result.requests) * 1e6,
                }
            )
    finally:
        for process in (proxy, prefill, decode):
            process.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows here as JSON")
    parser.add_argument(
        "--serve", nargs=3, metavar=("PORT", "PREFILL_URL", "DECODE_URL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.serve[2])
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="isogate-floor-") as work:
        started = time.time()
        rows = [
            {k: round(v, 3) for k, v in row.items()} for row in measure(args.seconds, Path(work))
        ]
        for row in rows:
            print(json.dumps({"target": "python_floor", **row}))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
        print(f"({time.time() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
