"""``isogate``: serve the gateway, gate a deployment on its pools, administer tenants and the
audit log."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from gateway.config.policies import PolicyError, load_policies
from gateway.config.settings import Settings
from gateway.observability.multiprocess import run_directory
from gateway.service.components import workers_of
from gateway.workers.capacity import Role, WorkerCapacity, json_getter, poll_worker
from gateway.workers.upstream import UpstreamClient

if TYPE_CHECKING:
    from gateway.api.app import Gateway

_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="isogate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway (uvicorn)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--workers",
        type=int,
        help="gateway processes on one port (default: one per core with Redis configured, else 1;"
        " more than 1 needs Redis, where they share KV claims and limits)",
    )
    serve.set_defaults(func=_serve)

    check = commands.add_parser(
        "check-pools", help="deployment gate: advertised context vs live KV pools"
    )
    check.add_argument("--policies-dir", type=Path)
    check.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="check this worker instead of the policies' (repeatable), e.g. prefill=http://h:30000",
    )
    check.set_defaults(func=_check_pools)

    from gateway.cli import admin as admin_commands

    admin_commands.register(commands)
    from gateway.cli import policies_check

    policies_check.register(commands)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _serve(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as run:  # what the run holds until the server stops
        return _serve_within(args, run)


def _serve_within(args: argparse.Namespace, run: contextlib.ExitStack) -> int:
    import uvicorn

    from gateway.api.app import create_app
    from gateway.observability.logs import configure_logging
    from gateway.server.http_server import ClientBounds, bounded_protocol

    try:
        settings = Settings()
    except ValidationError as exc:  # a bad setting: its message, not a traceback
        print(f"isogate: refusing to start: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    try:
        load_policies(settings.policies_dir)  # refuse a bad policy before binding the port
    except PolicyError as exc:
        print(f"isogate: refusing to start: {exc}", file=sys.stderr)
        return 2
    try:
        workers = worker_count(args.workers, settings.redis_url is not None, _cores())
    except ValueError as exc:
        print(f"isogate: refusing to start: {exc}", file=sys.stderr)
        return 2
    if workers > 1:
        # Each process is a full gateway built from the environment (uvicorn starts each with
        # the factory), and the pair queues' caps are split across every process that shares
        # the workers: this host's processes times the replicas the deployment declares.
        os.environ["ISOGATE_QUEUE_REPLICAS"] = str(settings.queue_replicas * workers)
        # Each process leaves its metrics there, so that any of them answers /metrics for all.
        os.environ["ISOGATE_METRICS_DIR"] = str(run.enter_context(run_directory()))
    uvicorn.run(
        create_app(settings) if workers == 1 else "gateway.cli.main:worker_app",
        factory=workers != 1,
        host=args.host or settings.host,
        port=args.port or settings.port,
        workers=workers,
        log_config=None,
        access_log=False,
        # The client's address behind the trusted proxies (X-Forwarded-For), by uvicorn's
        # middleware; without any, no middleware: it would look at every request's peer.
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=settings.forwarded_allow_ips or None,
        server_header=False,
        loop="uvloop",
        http=bounded_protocol(
            ClientBounds(
                header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s,
                max_header_bytes=settings.max_header_bytes,
                max_connections=settings.max_connections,
                deadline_resolution_s=settings.deadline_resolution_s,
                max_connections_per_address=settings.max_connections_per_address,
                first_byte_timeout_s=settings.first_byte_timeout_s,
                trusted_proxies=settings.forwarded_allow_ips,
            )
        ),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=30,
    )
    return 0


def worker_app() -> Gateway:
    """One process of ``serve --workers``: uvicorn starts each afresh, so each reads its settings
    from the environment and configures its own logging (else its logs would go nowhere)."""
    from gateway.api.app import create_app
    from gateway.observability.logs import configure_logging

    settings = Settings()
    configure_logging(settings)
    return create_app(settings)


def worker_count(requested: int | None, redis_configured: bool, cores: int) -> int:
    """How many gateway processes ``serve`` runs: ``requested``, else one per core with Redis
    and one without. Several without Redis is refused: each process would count only its own
    KV claims and tenant limits, so together they could admit what no pool holds."""
    if requested is None:
        return max(1, cores) if redis_configured else 1
    if requested < 1:
        raise ValueError(f"--workers must be at least 1, not {requested}")
    if requested > 1 and not redis_configured:
        raise ValueError(
            f"--workers {requested} needs Redis (ISOGATE_REDIS_URL): without it each process "
            "would count only its own KV claims and tenant limits, and together they could "
            "admit more than a pool holds"
        )
    return requested


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_pools(args: argparse.Namespace) -> int:
    workers: list[tuple[str, Role]]
    if args.worker:
        workers = []
        for item in args.worker:
            name, _, url = item.partition("=")
            role = _ROLES.get(name)
            if role is None or not url:
                print(
                    f"isogate check-pools: --worker wants ROLE=URL, got {item!r}", file=sys.stderr
                )
                return 2
            workers.append((url.rstrip("/"), role))
    else:
        try:
            policies = load_policies(args.policies_dir or Settings().policies_dir)
        except PolicyError as exc:
            print(f"isogate check-pools: {exc}", file=sys.stderr)
            return 2
        workers = workers_of(policies)
    results = asyncio.run(_poll_all(workers))
    return print_pool_table(results)


async def _poll_all(
    workers: list[tuple[str, Role]],
) -> list[tuple[str, str, WorkerCapacity | str]]:
    client = UpstreamClient(connect_timeout_s=5.0, timeout_s=5.0)
    get_json = json_getter(client)

    async def one(url: str, role: Role) -> tuple[str, str, WorkerCapacity | str]:
        try:
            state, _ = await poll_worker(get_json, url, role)
            return url, role, state
        except Exception as exc:  # report, don't crash: an unreachable worker fails the gate
            return url, role, f"unreachable: {type(exc).__name__}"

    try:
        return list(await asyncio.gather(*(one(url, role) for url, role in workers)))
    finally:
        await client.aclose()


def pool_verdict(state: WorkerCapacity) -> str | None:
    """Why a prompt under the advertised context length could exceed this worker's pool, or None."""
    if state.context_length is None:
        return None
    if state.context_length > state.max_total_num_tokens:
        return f"context length {state.context_length} > KV pool {state.max_total_num_tokens}"
    if state.max_req_input_len is not None and state.max_req_input_len > state.max_total_num_tokens:
        return f"max_req_input_len {state.max_req_input_len} > KV pool {state.max_total_num_tokens}"
    return None


def print_pool_table(results: list[tuple[str, str, WorkerCapacity | str]]) -> int:
    header = (
        "worker",
        "role",
        "context_length",
        "kv_pool_tokens",
        "max_req_input_len",
        "engine_patch",
        "verdict",
    )
    rows = [header]
    failed = 0
    for url, role, state in results:
        if isinstance(state, str):
            rows.append((url, role, "-", "-", "-", "-", f"FAIL {state}"))
            failed += 1
            continue
        problem = pool_verdict(state)
        failed += problem is not None
        rows.append(
            (
                url,
                role,
                str(state.context_length),
                str(state.max_total_num_tokens),
                str(state.max_req_input_len),
                state.engine_patch or "no",
                f"FAIL {problem}" if problem else "ok",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if failed:
        print(
            f"\n{failed} worker(s) fail the pool gate: a prompt under the advertised context "
            "length could exceed a KV pool (or the worker is unreachable).",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
